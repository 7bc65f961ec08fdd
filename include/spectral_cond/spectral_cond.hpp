// spectral_cond: the umbrella header. Includes everything but the checkpoint readers
// (spectral_cond/io/*.hpp, which need nlohmann_json and zlib: link spectral_cond::io) and the
// CUDA path (spectral_cond/cuda/*.cuh), which are included explicitly by the code that wants them.
#pragma once

#include "spectral_cond/attention.hpp"
#include "spectral_cond/bound.hpp"
#include "spectral_cond/common.hpp"
#include "spectral_cond/compressed.hpp"
#include "spectral_cond/conditioned.hpp"
#include "spectral_cond/corrections.hpp"
#include "spectral_cond/finite_diff.hpp"
#include "spectral_cond/gram.hpp"
#include "spectral_cond/jacobian.hpp"
#include "spectral_cond/jacobian_kappa.hpp"
#include "spectral_cond/kappa.hpp"
#include "spectral_cond/multihead.hpp"
#include "spectral_cond/multihead_jacobian.hpp"
#include "spectral_cond/operators.hpp"
#include "spectral_cond/qr_kappa.hpp"
