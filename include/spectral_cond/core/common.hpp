// spectral_cond: shared types, scalar traits and argument checking.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace spectral_cond {

/// Column-major dynamic matrix, the storage MATH.md §1's vec convention assumes.
template <typename Scalar>
using Mat = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
template <typename Scalar>
using Vec = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

namespace detail {
template <typename T>
struct identity {
  using type = T;
};
}  // namespace detail

/// Writable view of caller storage (a Mat, a Map, a column block). Scalar is not deduced from
/// it: the library's functions deduce Scalar from their cache, workspace or options argument.
template <typename Scalar>
using Ref = Eigen::Ref<Mat<typename detail::identity<Scalar>::type>>;
/// Read-only view (any matrix expression; non-contiguous ones are copied by Eigen).
template <typename Scalar>
using CRef = Eigen::Ref<const Mat<typename detail::identity<Scalar>::type>>;

using Index = Eigen::Index;

/// Outcome of a numerical computation. Numerical outcomes are results, not exceptions.
enum class Info {
  Success,        ///< computed as asked
  Singular,       ///< the matrix is singular: kappa = +inf
  NotConverging,  ///< an iterative method stopped before its tolerance was met
  InvalidInput,   ///< NaN or Inf in the input
  Inaccurate,     ///< computed, but the stated accuracy makes the value meaningless
  TooLarge,       ///< not computed: every method's estimated memory exceeds the budget
};

inline const char* to_string(Info info) {
  switch (info) {
    case Info::Success:
      return "success";
    case Info::Singular:
      return "singular";
    case Info::NotConverging:
      return "not_converging";
    case Info::InvalidInput:
      return "invalid_input";
    case Info::Inaccurate:
      return "inaccurate";
    case Info::TooLarge:
      return "too_large";
  }
  return "unknown";
}

/// Additive mask on the logits Z = c Q K^T + M (MATH.md §1).
enum class MaskKind {
  None,      ///< M = 0
  Causal,    ///< M_ij = -inf for j > i: token i attends to tokens 0..i
  Additive,  ///< a user N x N matrix of finite values and -inf
};

inline const char* to_string(MaskKind m) {
  switch (m) {
    case MaskKind::None:
      return "none";
    case MaskKind::Causal:
      return "causal";
    case MaskKind::Additive:
      return "additive";
  }
  return "unknown";
}

/// Tolerances in units of machine epsilon, one place for float and double.
template <typename Scalar>
struct ScalarTraits {
  static constexpr Scalar eps() { return std::numeric_limits<Scalar>::epsilon(); }
  static Scalar sqrt_eps() { return Eigen::numext::sqrt(eps()); }
  /// Step for central differences: cbrt(eps) balances truncation O(h^2) against rounding O(eps/h).
  static Scalar fd_step() { return std::cbrt(eps()); }
  static constexpr Scalar inf() { return std::numeric_limits<Scalar>::infinity(); }
};

/// min(a, b) with NaN read as "no value": the other argument when one is NaN, NaN when both
/// are. For running extremes over results that may be undefined (a ratio of two infinite κ),
/// started at NaN.
inline double min_ignoring_nan(double a, double b) {
  return std::isnan(a) ? b : std::isnan(b) ? a : std::min(a, b);
}
/// max(a, b) with NaN read as "no value", as min_ignoring_nan.
inline double max_ignoring_nan(double a, double b) {
  return std::isnan(a) ? b : std::isnan(b) ? a : std::max(a, b);
}

/// "r x c": a matrix's shape as every argument check of the library writes it
/// ("attention_vjp: G must be N x d_v = 3 x 4 (got 3 x 5)").
inline std::string shape_str(Index r, Index c) {
  std::ostringstream s;
  s << r << " x " << c;
  return s.str();
}

namespace detail {

using spectral_cond::shape_str;  // the argument checks' name for it

/// Throws std::invalid_argument("fn: arg must be <what> = R x C (got r x c)").
template <typename Derived>
void require_shape(const char* fn, const char* arg, const char* what, Index rows, Index cols,
                   const Eigen::MatrixBase<Derived>& m) {
  if (m.rows() != rows || m.cols() != cols) {
    std::ostringstream s;
    s << fn << ": " << arg << " must be " << what << " = " << shape_str(rows, cols) << " (got "
      << shape_str(m.rows(), m.cols()) << ")";
    throw std::invalid_argument(s.str());
  }
}

[[noreturn]] inline void fail(const std::string& fn, const std::string& msg) {
  throw std::invalid_argument(fn + ": " + msg);
}

/// Resizes only when the shape differs, so steady-state calls allocate nothing.
template <typename M>
void ensure_size(M& m, Index rows, Index cols) {
  if (m.rows() != rows || m.cols() != cols) m.resize(rows, cols);
}

template <typename Scalar>
void check_nonempty(const char* fn, const Eigen::Ref<const Mat<Scalar>>& M) {
  if (M.rows() < 1 || M.cols() < 1)
    fail(fn,
         "M must have at least one row and one column (got " + shape_str(M.rows(), M.cols()) + ")");
}

template <typename Derived>
bool all_finite(const Eigen::MatrixBase<Derived>& m) {
  return m.allFinite();
}

}  // namespace detail
}  // namespace spectral_cond
