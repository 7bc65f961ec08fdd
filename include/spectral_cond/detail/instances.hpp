// spectral_cond: the one list of the precompiled instances (the project's own build target
// spectral_cond_instances, src/instances_*.cpp). Each group below is a list of explicit
// instantiations for a scalar S; the header that defines a group's templates ends with
// SPECTRAL_COND_DECLARE_EXTERN(group), which, where SPECTRAL_COND_EXTERN_INSTANCES is defined
// (targets linked to spectral_cond_instances), declares them `extern template` for float and
// double, so that those translation units do not instantiate them again; src/instances_*.cpp
// define every group from the same list. Users of the header-only library are not affected.
#pragma once

#define SPECTRAL_COND_INSTANCES_svd(X, S)                  \
  X(template class Eigen::BDCSVD<spectral_cond::Mat<S>>)   \
  X(template class Eigen::JacobiSVD<spectral_cond::Mat<S>, \
                                    Eigen::ColPivHouseholderQRPreconditioner>)

#define SPECTRAL_COND_INSTANCES_compressed(X, S)         \
  X(template class spectral_cond::CompressedJacobian<S>) \
  X(template class spectral_cond::CompressedInputJacobian<S>)

#define SPECTRAL_COND_INSTANCES_kappa_jacobian(X, S)                                               \
  X(template spectral_cond::ConditionResult<double> spectral_cond::kappa_jacobian<S>(              \
      const spectral_cond::CRef<S>&, const spectral_cond::CRef<S>&, const spectral_cond::CRef<S>&, \
      const spectral_cond::CRef<S>&, const spectral_cond::AttentionOptions<S>&,                    \
      const spectral_cond::JacobianKappaOptions&))

#define SPECTRAL_COND_INSTANCES_theorem34(X, S)                                                    \
  X(template spectral_cond::Theorem34Report spectral_cond::theorem34<S>(                           \
      const spectral_cond::CRef<S>&, const spectral_cond::CRef<S>&, const spectral_cond::CRef<S>&, \
      const spectral_cond::CRef<S>&, const spectral_cond::AttentionOptions<S>&,                    \
      const spectral_cond::BoundOptions&))                                                         \
  X(template spectral_cond::Theorem34Report spectral_cond::theorem34<S>(                           \
      const spectral_cond::CRef<S>&, const spectral_cond::CRef<S>&, const spectral_cond::CRef<S>&, \
      const spectral_cond::CRef<S>&, const spectral_cond::AttentionOptions<S>&,                    \
      const spectral_cond::BoundOptions&, const spectral_cond::ConditionResult<double>&))

/// Every group, in two parts of about equal compile time, one per source file
/// (src/instances_decompositions.cpp and src/instances_methods.cpp), so that they compile in
/// parallel; the second sees the first's `extern template` declarations and does not instantiate
/// them again.
#define SPECTRAL_COND_INSTANCES_DECOMPOSITIONS(X, S) \
  SPECTRAL_COND_INSTANCES_svd(X, S) SPECTRAL_COND_INSTANCES_compressed(X, S)
#define SPECTRAL_COND_INSTANCES_METHODS(X, S) \
  SPECTRAL_COND_INSTANCES_kappa_jacobian(X, S) SPECTRAL_COND_INSTANCES_theorem34(X, S)

#define SPECTRAL_COND_INSTANCE_EXTERN(...) extern __VA_ARGS__;
#define SPECTRAL_COND_INSTANCE_DEFINE(...) __VA_ARGS__;

#ifdef SPECTRAL_COND_EXTERN_INSTANCES
#define SPECTRAL_COND_DECLARE_EXTERN(group)                             \
  SPECTRAL_COND_INSTANCES_##group(SPECTRAL_COND_INSTANCE_EXTERN, float) \
      SPECTRAL_COND_INSTANCES_##group(SPECTRAL_COND_INSTANCE_EXTERN, double)
#else
#define SPECTRAL_COND_DECLARE_EXTERN(group)
#endif
