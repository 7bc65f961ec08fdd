// spectral_cond: matrix-free Jacobian operators in Spectra's style (MATH.md §2–3).
//
//   JacobianOp           y = J x          (rows x cols)
//   JacobianTransposeOp  y = J^T x        (cols x rows)
//   GramOp               y = J J^T x      (rows x rows, symmetric PSD)
//   NormalOp             y = J^T J x      (cols x cols, symmetric PSD)
//
// J is the block `block` of the attention Jacobian (default All = [J_Q | J_K | J_V]); vectors are
// column-major vecs in the column order of MATH.md §1. Each product is one JVP and/or one VJP
// (attention_jvp / attention_vjp): O(N D (d_k + d_v) + N^2 (d_k + d_v)), never J itself. Every
// operator copies X and the weights and runs the forward pass once, in its constructor; all
// buffers are sized there, so perform_op allocates nothing. Plug into Spectra directly:
// `Spectra::SymEigsSolver<GramOp<double>> eigs(op, nev, ncv);`.
#pragma once

#include "spectral_cond/core/attention.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"

namespace spectral_cond {

namespace detail {

/// The shared state of the operators: copies of the inputs, the forward cache and the buffers.
template <typename Scalar>
class JacobianProducts {
 public:
  JacobianProducts(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                   JacobianBlock block, const char* fn)
      : X_(X), WQ_(WQ), WK_(WK), WV_(WV), block_(block) {
    check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
    opts.check(fn, X.rows());
    attention_forward<Scalar>(X_, WQ_, WK_, WV_, opts, cache_);
    N_ = X_.rows();
    D_ = X_.cols();
    dk_ = WQ_.cols();
    dv_ = WV_.cols();
    rows_ = jacobian_rows(N_, dv_);
    cols_ = jacobian_cols(block, N_, D_, dk_, dv_);
    ws_.dQ.resize(N_, dk_);
    ws_.dK.resize(N_, dk_);
    ws_.dV.resize(N_, dv_);
    ws_.NxN.resize(N_, N_);
    ws_.r.resize(N_);
  }

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  JacobianBlock block() const { return block_; }
  const AttentionCache<Scalar>& cache() const { return cache_; }

  /// y (rows) = J x (cols).
  void apply(const Scalar* x, Scalar* y) const {
    using CMap = Eigen::Map<const Mat<Scalar>>;
    const Scalar* p = x;
    auto next = [&p](bool on, Index r, Index c) {
      if (!on) return CMap(nullptr, 0, 0);
      CMap m(p, r, c);
      p += r * c;
      return m;
    };
    const bool all = block_ == JacobianBlock::All;
    const CMap dWQ = next(all || block_ == JacobianBlock::Q, D_, dk_);
    const CMap dWK = next(all || block_ == JacobianBlock::K, D_, dk_);
    const CMap dWV = next(all || block_ == JacobianBlock::V, D_, dv_);
    const CMap dX = next(block_ == JacobianBlock::X, N_, D_);
    Eigen::Map<Mat<Scalar>> dA(y, N_, dv_);
    attention_jvp<Scalar>(X_, WQ_, WK_, WV_, cache_, dWQ, dWK, dWV, dX, ws_, dA);
  }

  /// y (cols) = J^T x (rows).
  void apply_transpose(const Scalar* x, Scalar* y) const {
    using MMap = Eigen::Map<Mat<Scalar>>;
    Scalar* p = y;
    auto next = [&p](bool on, Index r, Index c) {
      if (!on) return MMap(nullptr, 0, 0);
      MMap m(p, r, c);
      p += r * c;
      return m;
    };
    const bool all = block_ == JacobianBlock::All;
    MMap gWQ = next(all || block_ == JacobianBlock::Q, D_, dk_);
    MMap gWK = next(all || block_ == JacobianBlock::K, D_, dk_);
    MMap gWV = next(all || block_ == JacobianBlock::V, D_, dv_);
    MMap gX = next(block_ == JacobianBlock::X, N_, D_);
    const Eigen::Map<const Mat<Scalar>> G(x, N_, dv_);
    attention_vjp<Scalar>(X_, WQ_, WK_, WV_, cache_, G, ws_, gWQ, gWK, gWV, gX);
  }

 private:
  Mat<Scalar> X_, WQ_, WK_, WV_;
  JacobianBlock block_;
  AttentionCache<Scalar> cache_;
  mutable AttentionWorkspace<Scalar> ws_;
  Index N_ = 0, D_ = 0, dk_ = 0, dv_ = 0, rows_ = 0, cols_ = 0;
};

}  // namespace detail

/// y = J x for the block `block` of the attention Jacobian (MATH.md §3), by one JVP (§2).
template <typename Scalar_>
class JacobianOp {
 public:
  using Scalar = Scalar_;
  JacobianOp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
             const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {},
             JacobianBlock block = JacobianBlock::All)
      : J_(X, WQ, WK, WV, opts, block, "JacobianOp") {}
  Index rows() const { return J_.rows(); }
  Index cols() const { return J_.cols(); }
  void perform_op(const Scalar* x_in, Scalar* y_out) const { J_.apply(x_in, y_out); }

 private:
  detail::JacobianProducts<Scalar> J_;
};

/// y = J^T x, by one VJP (MATH.md §2).
template <typename Scalar_>
class JacobianTransposeOp {
 public:
  using Scalar = Scalar_;
  JacobianTransposeOp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                      const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {},
                      JacobianBlock block = JacobianBlock::All)
      : J_(X, WQ, WK, WV, opts, block, "JacobianTransposeOp") {}
  Index rows() const { return J_.cols(); }
  Index cols() const { return J_.rows(); }
  void perform_op(const Scalar* x_in, Scalar* y_out) const { J_.apply_transpose(x_in, y_out); }

 private:
  detail::JacobianProducts<Scalar> J_;
};

/// y = J J^T x (N d_v x N d_v), one VJP then one JVP. Its eigenvalues are the squared singular
/// values of J (MATH.md §3): the operator for the wide case.
template <typename Scalar_>
class GramOp {
 public:
  using Scalar = Scalar_;
  GramOp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
         const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {},
         JacobianBlock block = JacobianBlock::All)
      : J_(X, WQ, WK, WV, opts, block, "GramOp"), t_(J_.cols()) {}
  Index rows() const { return J_.rows(); }
  Index cols() const { return J_.rows(); }
  void perform_op(const Scalar* x_in, Scalar* y_out) const {
    J_.apply_transpose(x_in, t_.data());
    J_.apply(t_.data(), y_out);
  }

 private:
  detail::JacobianProducts<Scalar> J_;
  mutable Vec<Scalar> t_;
};

/// y = J^T J x (cols x cols), one JVP then one VJP: the operator for the tall case.
template <typename Scalar_>
class NormalOp {
 public:
  using Scalar = Scalar_;
  NormalOp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
           const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {},
           JacobianBlock block = JacobianBlock::All)
      : J_(X, WQ, WK, WV, opts, block, "NormalOp"), t_(J_.rows()) {}
  Index rows() const { return J_.cols(); }
  Index cols() const { return J_.cols(); }
  void perform_op(const Scalar* x_in, Scalar* y_out) const {
    J_.apply(x_in, t_.data());
    J_.apply_transpose(t_.data(), y_out);
  }

 private:
  detail::JacobianProducts<Scalar> J_;
  mutable Vec<Scalar> t_;
};

}  // namespace spectral_cond
