// spectral_cond: rotary position embeddings (RoPE, MATH.md §10).
//
// Row i of Q and of K is rotated after the projection: q~_i = q_i R_i with R_i orthogonal and
// made of 2 x 2 rotations by the angles (offset + i) ω_j, ω_j = theta^(-2j / dims), one for each
// pair of columns (b, p(b)). Two pairings are in use:
//
//   rotate_half   (b, b + dims/2) for b < dims/2   (Hugging Face's rotate_half: Llama, Qwen2, …)
//   interleaved   (2j, 2j + 1)                      (GPT-J, Meta's original Llama code)
//
// Columns past `dims` (partial rotary, GPT-NeoX's rotary_pct) are not rotated. The angles'
// cosines and sines may instead be given as tables (RopeOptions::cos, ::sin, N x dims), as a model
// computes them (any frequency schedule, any positions, and a scaled rotation where a model
// multiplies both by an attention factor, as YaRN does). For the first
// member b of a pair, R_i[b, b] = cos, R_i[b, p] = +sin; for the second, R_i[b, p] = -sin. With
// s_b that sign and the N x d_k tables C[i, b] = cos((offset + i) ω_b) and
// S[i, b] = s_b sin((offset + i) ω_b):
//
//   rotate:            M~[:, b] = C[:, b] ∘ M[:, b] - S[:, b] ∘ M[:, p(b)]      (M R)
//   rotate_transpose:  M~[:, b] = C[:, b] ∘ M[:, b] + S[:, b] ∘ M[:, p(b)]      (M R^T)
//
// and the row of R_i for column b is C[i, b] e_b + S[i, b] e_{p(b)}: what the Jacobian's
// columns mix (jacobian.hpp). Unrotated columns have C = 1, S = 0 and p(b) = b.
#pragma once

#include "spectral_cond/core/common.hpp"

#include <cmath>
#include <string>
#include <vector>

namespace spectral_cond {

/// Which columns RoPE rotates together (MATH.md §10).
enum class RopePairing {
  RotateHalf,   ///< (b, b + dims/2): Hugging Face's rotate_half
  Interleaved,  ///< (2j, 2j + 1): GPT-J and Meta's original Llama
};

inline const char* to_string(RopePairing p) {
  return p == RopePairing::RotateHalf ? "rotate_half" : "interleaved";
}

/// Parses "rotate_half" or "interleaved"; throws std::invalid_argument otherwise.
inline RopePairing parse_rope_pairing(const std::string& s) {
  if (s == "rotate_half") return RopePairing::RotateHalf;
  if (s == "interleaved") return RopePairing::Interleaved;
  throw std::invalid_argument("rope pairing: unknown '" + s +
                              "' (expected rotate_half or interleaved)");
}

/// Rotary position embeddings of the queries and keys of one head (MATH.md §10).
struct RopeOptions {
  RopePairing pairing = RopePairing::RotateHalf;
  /// The base of the frequencies ω_j = theta^(-2j / dims) (Hugging Face's rope_theta).
  double theta = 10000;
  /// Rotated columns per head, even; 0 (default) means all d_k.
  Index dims = 0;
  /// The position of token 0 (tokens are at offset, offset + 1, …).
  Index offset = 0;
  /// Explicit tables, both N x dims or both empty (default): cos(i, b) and sin(i, b) of token i's
  /// angle for rotated column b, in the layout the pairing implies (rotate_half: column b and
  /// b + dims/2 share an angle; interleaved: 2j and 2j + 1), as Hugging Face's
  /// position_embeddings hold them. When set, theta and offset are not used, and the tables need
  /// not satisfy cos² + sin² = 1 (a model may scale both, MATH.md §10).
  Eigen::MatrixXd cos, sin;

  Index resolved_dims(Index d_k) const {
    return cos.cols() > 0 ? cos.cols() : dims == 0 ? d_k : dims;
  }
  bool has_tables() const { return cos.size() > 0 || sin.size() > 0; }

  /// Throws std::invalid_argument naming `fn` when RoPE cannot apply to heads of width d_k
  /// (AttentionOptions::check compares the tables' rows with N).
  void check(const char* fn, Index d_k) const {
    std::ostringstream s;
    const Index r = resolved_dims(d_k);
    if (!(std::isfinite(theta) && theta > 1))
      s << "rope theta must be finite and > 1 (got " << theta << ")";
    else if (dims < 0 || r > d_k || r % 2 != 0)
      s << "rope dims must be even and at most d_k = " << d_k << " (got " << r << ")";
    else if (offset < 0)
      s << "rope offset must be >= 0 (got " << offset << ")";
    else if (has_tables() && (cos.rows() != sin.rows() || cos.cols() != sin.cols()))
      s << "rope cos and sin tables must have the same shape (got " << cos.rows() << " x "
        << cos.cols() << " and " << sin.rows() << " x " << sin.cols() << ")";
    else if (has_tables() && dims != 0 && dims != cos.cols())
      s << "rope dims (" << dims << ") must equal the tables' width (" << cos.cols() << ")";
    else if (has_tables() && !(cos.allFinite() && sin.allFinite()))
      s << "rope cos and sin tables must be finite";
    if (!s.str().empty()) detail::fail(fn, s.str());
  }
};

namespace detail {

/// The tables C, S and the partner of every column of a head of width d_k, for N positions.
template <typename Scalar>
struct RopeTable {
  bool active = false;
  Mat<Scalar> C, S;            ///< N x d_k
  std::vector<Index> partner;  ///< p(b)

  void build(const RopeOptions& o, Index N, Index d_k) {
    active = true;
    const Index r = o.resolved_dims(d_k), half = r / 2;
    ensure_size(C, N, d_k);
    ensure_size(S, N, d_k);
    partner.resize(static_cast<std::size_t>(d_k));
    for (Index b = 0; b < d_k; ++b) {
      Index j = -1, p = b;  // j: the pair's frequency index; -1 for an unrotated column
      double sign = 1;
      if (b < r) {
        if (o.pairing == RopePairing::RotateHalf) {
          j = b < half ? b : b - half;
          p = b < half ? b + half : b - half;
          sign = b < half ? 1 : -1;
        } else {
          j = b / 2;
          p = b % 2 == 0 ? b + 1 : b - 1;
          sign = b % 2 == 0 ? 1 : -1;
        }
      }
      partner[static_cast<std::size_t>(b)] = p;
      if (o.has_tables()) {  // the model's own angles (checked N x r by RopeOptions::check)
        for (Index i = 0; i < N; ++i) {
          C(i, b) = static_cast<Scalar>(j < 0 ? 1.0 : o.cos(i, b));
          S(i, b) = static_cast<Scalar>(j < 0 ? 0.0 : sign * o.sin(i, b));
        }
        continue;
      }
      const double w =
          j < 0 ? 0.0 : std::pow(o.theta, -2.0 * static_cast<double>(j) / static_cast<double>(r));
      for (Index i = 0; i < N; ++i) {
        const double angle = static_cast<double>(o.offset + i) * w;
        C(i, b) = static_cast<Scalar>(std::cos(angle));
        S(i, b) = static_cast<Scalar>(sign * std::sin(angle));
      }
    }
  }

  void clear() { active = false; }

  /// In place, on every block of d_k columns of M (fused heads): M <- M R (or M R^T).
  template <typename Derived>
  void apply(Eigen::MatrixBase<Derived>& M, bool transpose, Mat<Scalar>& scratch) const {
    if (!active) return;
    const Index dk = C.cols(), heads = M.cols() / dk;
    const Scalar sgn = transpose ? Scalar(1) : Scalar(-1);
    ensure_size(scratch, M.rows(), dk);
    for (Index h = 0; h < heads; ++h) {
      auto blk = M.middleCols(h * dk, dk);
      scratch = blk;
      for (Index b = 0; b < dk; ++b)
        blk.col(b) = C.col(b).cwiseProduct(scratch.col(b)) +
                     sgn * S.col(b).cwiseProduct(scratch.col(partner[static_cast<std::size_t>(b)]));
    }
  }
};

}  // namespace detail
}  // namespace spectral_cond
