// spectral-cond: what every subcommand shares: exit codes, the error types that carry them, and
// loading and writing matrices with one-line messages that name the file.
//
// Exit codes: 0 success, 1 internal error, 2 bad input (a file, a tensor in it, or an
// argument; CLI11 parse errors too), 3 numerical failure (the computation produced NaN or Inf,
// or did not converge). Subcommands throw; main() maps exceptions to codes and prints one line,
// "spectral-cond: error: <message>", on stderr.
#pragma once

#include <spectral_cond/conditioning/methods/options.hpp>
#include <spectral_cond/core/attention.hpp>
#include <spectral_cond/core/common.hpp>
#include <spectral_cond/io/formats/npy.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace spectral_cond::engine {

enum ExitCode : int {
  kSuccess = 0,
  kInternalError = 1,
  kBadInput = 2,
  kNumericalFailure = 3,
};

/// An error with the exit code it maps to. The message is one line.
class Error : public std::runtime_error {
 public:
  Error(int code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

/// A file, a tensor or an argument that cannot be used (exit 2).
struct BadInput : Error {
  explicit BadInput(const std::string& msg) : Error(kBadInput, msg) {}
};

/// A computation that produced NaN or Inf, or did not converge (exit 3).
struct NumericalFailure : Error {
  explicit NumericalFailure(const std::string& msg) : Error(kNumericalFailure, msg) {}
};

/// The memory the tool allows itself for one piece of work, in bytes: a quarter of physical
/// memory (the κ(J) methods' budget, JacobianKappaOptions::memory_budget), or
/// SPECTRAL_COND_MEMORY_BUDGET bytes where that environment variable holds a positive integer
/// (shared machines, tests). `analyze --tokens` and `correct` are refused beyond it, before any
/// work (docs/cli.md).
inline double memory_budget_bytes() {
  if (const char* env = std::getenv("SPECTRAL_COND_MEMORY_BUDGET")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end != env && *end == '\0' && v > 0) return static_cast<double>(v);
  }
  return static_cast<double>(JacobianKappaOptions{}.resolved_memory_budget());
}

/// Reads a 2-D float32 or float64 .npy file (C or Fortran order) as double. `role` names the
/// tensor in messages ("X", "W_Q"). Throws io::IoError (malformed file, not 2-D) or BadInput
/// (NaN or Inf entries), naming the file.
inline Mat<double> load_matrix(const std::string& path, const std::string& role) {
  const io::NpyArray a = io::read_npy(path);
  if (a.ndim() != 2)
    throw BadInput(path + ": " + role + " must be a 2-D array, got shape " + a.shape_string());
  Mat<double> m = a.to_matrix();
  for (Index j = 0; j < m.cols(); ++j)
    for (Index i = 0; i < m.rows(); ++i)
      if (!std::isfinite(m(i, j)))
        throw BadInput(path + ": " + role + " has a NaN or Inf entry at [" + std::to_string(i) +
                       ", " + std::to_string(j) + "]");
  return m;
}

/// Throws BadInput("<path>: <role> must be R x C (<why>), got r x c") on a shape mismatch.
inline void require_shape(const std::string& path, const std::string& role, const std::string& why,
                          Index rows, Index cols, const Mat<double>& m) {
  if (m.rows() != rows || m.cols() != cols)
    throw BadInput(path + ": " + role + " must be " + shape_str(rows, cols) + " (" + why +
                   "), got " + shape_str(m.rows(), m.cols()));
}

/// The inputs of one attention block, read from the .npy files of --x, --wq, --wk and --wv.
struct AttentionFiles {
  Mat<double> X, WQ, WK, WV;
};

/// Reads X, W_Q, W_K and W_V (load_matrix) and checks their shapes against each other: X N x D
/// with N, D >= 1, W_Q and W_K D x d_k, W_V D x d_v, d_k, d_v >= 1. Messages name the files.
inline AttentionFiles load_attention_files(const std::string& x, const std::string& wq,
                                           const std::string& wk, const std::string& wv) {
  AttentionFiles in;
  in.X = load_matrix(x, "X");
  if (in.X.rows() < 1 || in.X.cols() < 1)
    throw BadInput(x + ": X must be N x D with N, D >= 1 (got " +
                   shape_str(in.X.rows(), in.X.cols()) + ")");
  const Index D = in.X.cols();
  in.WQ = load_matrix(wq, "W_Q");
  require_shape(wq, "W_Q", "D x d_k with D = " + std::to_string(D) + " from " + x, D, in.WQ.cols(),
                in.WQ);
  if (in.WQ.cols() < 1) throw BadInput(wq + ": W_Q must have at least one column (d_k >= 1)");
  in.WK = load_matrix(wk, "W_K");
  require_shape(wk, "W_K", "D x d_k, D from " + x + ", d_k from " + wq, D, in.WQ.cols(), in.WK);
  in.WV = load_matrix(wv, "W_V");
  require_shape(wv, "W_V", "D x d_v with D = " + std::to_string(D) + " from " + x, D, in.WV.cols(),
                in.WV);
  if (in.WV.cols() < 1) throw BadInput(wv + ": W_V must have at least one column (d_v >= 1)");
  return in;
}

/// Throws NumericalFailure (exit 3) naming `files` unless attention's forward pass (MATH.md §1)
/// on these finite inputs is finite: logits c Q K^T beyond the range of double make P, and so J,
/// NaN, and no method could answer. Checked before κ(J) is computed, so that no result (and no
/// verdict of Theorem 3.4) is ever drawn from NaN.
inline void require_finite_attention(const Mat<double>& X, const Mat<double>& WQ,
                                     const Mat<double>& WK, const Mat<double>& WV,
                                     const AttentionOptions<double>& opts,
                                     const std::string& files) {
  const AttentionCache<double> c = attention_forward(X, WQ, WK, WV, opts);
  const char* what = !c.Q.allFinite() || !c.K.allFinite() ? "Q = X W_Q or K = X W_K"
                     : !c.P.allFinite()                   ? "the logits c Q K^T"
                     : !c.A.allFinite()                   ? "the attention output P X W_V"
                                                          : nullptr;
  if (what != nullptr)
    throw NumericalFailure(files + ": " + what +
                           " overflow double: NaN or Inf in the attention, so J has NaN or Inf "
                           "entries (are the inputs very large?)");
}

/// Throws NumericalFailure unless every entry of `m` is finite.
inline void require_finite(const Mat<double>& m, const std::string& what) {
  if (!m.allFinite())
    throw NumericalFailure(what + " has NaN or Inf entries (are the inputs very large?)");
}

}  // namespace spectral_cond::engine
