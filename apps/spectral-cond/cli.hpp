// spectral-cond: what every subcommand shares: exit codes, the error types that carry them, and
// loading and writing matrices with one-line messages that name the file.
//
// Exit codes: 0 success, 1 internal error, 2 bad input (a file, a tensor in it, or an
// argument; CLI11 parse errors too), 3 numerical failure (the computation produced NaN or Inf,
// or did not converge). Subcommands throw; main() maps exceptions to codes and prints one line,
// "spectral-cond: error: <message>", on stderr.
#pragma once

#include <spectral_cond/core/attention.hpp>
#include <spectral_cond/core/common.hpp>
#include <spectral_cond/io/npy.hpp>

#include <stdexcept>
#include <string>

namespace spectral_cond::cli {

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

}  // namespace spectral_cond::cli
