// spectral_cond: the umbrella header (docs/architecture.md has the module map). It includes the
// numerical library: core/ (types, the seeded generator, attention and multi-head attention),
// jacobian/ (J, its Gram matrices, matrix-free operators, compressed forms), linalg/ (the SVDs,
// eigensolvers, Lanczos, LOBPCG and the structured QR the methods share), conditioning/ (κ, the
// κ(J) methods, the bound of Theorem 3.4, the corrections, conditioned attention) and testing/
// (finite differences and the single checks of the proven statements). Not included: the
// checkpoint readers (spectral_cond/io/, which need nlohmann_json and zlib: link
// spectral_cond::io) and the CUDA path (spectral_cond/cuda/).
#pragma once

#include "spectral_cond/core/attention.hpp"
#include "spectral_cond/core/common.hpp"
#include "spectral_cond/core/multihead.hpp"
#include "spectral_cond/core/random.hpp"

#include "spectral_cond/jacobian/compressed.hpp"
#include "spectral_cond/jacobian/gram.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/jacobian/multihead_jacobian.hpp"
#include "spectral_cond/jacobian/operators.hpp"

#include "spectral_cond/conditioning/advisor.hpp"
#include "spectral_cond/conditioning/bound.hpp"
#include "spectral_cond/conditioning/conditioned.hpp"
#include "spectral_cond/conditioning/corrections.hpp"
#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/conditioning/methods/kappa_jacobian.hpp"

#include "spectral_cond/testing/checks.hpp"
#include "spectral_cond/testing/finite_diff.hpp"
