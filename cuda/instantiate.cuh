// The explicit instantiations of the host API (spectral_cond/cuda/api.hpp) for one scalar,
// shared by the library's translation units (one per scalar, so that they compile in parallel).
#pragma once

#include "spectral_cond/cuda/cuda.cuh"

#define SC_INSTANTIATE(S)                                                                          \
  template std::vector<AttentionCache<S>> attention_forward_batched<S>(Context&,                   \
                                                                       const AttentionBatch<S>&);  \
  template std::vector<Mat<S>> attention_jvp_batched<S>(Context&, const AttentionBatch<S>&,        \
                                                        const std::vector<AttentionTangents<S>>&); \
  template std::vector<AttentionGradients<S>> attention_vjp_batched<S>(                            \
      Context&, const AttentionBatch<S>&, const std::vector<Mat<S>>&);                             \
  template std::vector<Mat<S>> attention_gram_batched<S>(Context&, const AttentionBatch<S>&);      \
  template Mat<S> attention_jacobian<S>(Context&, const Mat<S>&, const Mat<S>&, const Mat<S>&,     \
                                        const Mat<S>&, const AttentionOptions<S>&);                \
  template std::vector<ConditionResult<double>> kappa_jacobian_batched<S>(                         \
      Context&, const AttentionBatch<S>&, const CudaKappaOptions&);                                \
  template std::vector<ConditionResult<S>> kappa_batched<S>(Context&, const std::vector<Mat<S>>&,  \
                                                            const KappaOptions<S>&);               \
  template std::vector<ExactCorrection<S>> exact_correction_batched<S>(                            \
      Context&, const std::vector<Mat<S>>&, std::optional<S>);
