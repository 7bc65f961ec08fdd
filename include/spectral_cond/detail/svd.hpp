#pragma once
// Eigen's dense SVDs, which every condition number and correction of the library goes through.
// Where SPECTRAL_COND_EXTERN_INSTANCES is defined (the project's own build target
// spectral_cond_instances sets it; see the end of bound.hpp and src/instances_*.cpp), the two
// classes are declared explicitly instantiated elsewhere, so that each translation unit does not
// instantiate them again. Users of the header-only library are not affected.
#include "spectral_cond/common.hpp"

#include <Eigen/SVD>

#ifdef SPECTRAL_COND_EXTERN_INSTANCES
#define SPECTRAL_COND_SVD_CLASSES(EXTERN, S)                    \
  EXTERN template class Eigen::BDCSVD<spectral_cond::Mat<S>>;   \
  EXTERN template class Eigen::JacobiSVD<spectral_cond::Mat<S>, \
                                         Eigen::ColPivHouseholderQRPreconditioner>;
SPECTRAL_COND_SVD_CLASSES(extern, float)
SPECTRAL_COND_SVD_CLASSES(extern, double)
#endif
