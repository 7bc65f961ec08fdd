// spectral_cond: the umbrella header. Includes everything but the CUDA path
// (spectral_cond/cuda/*.cuh), which is included explicitly by the code that wants it.
#pragma once

#include "spectral_cond/attention.hpp"
#include "spectral_cond/common.hpp"
#include "spectral_cond/finite_diff.hpp"
#include "spectral_cond/multihead.hpp"
