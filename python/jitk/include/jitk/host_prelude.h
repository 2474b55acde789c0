// What every host half (a kernel file's host side built by the host compiler alone,
// jitk/nvrtc.cuh) reads before its own code: jitk's host headers and the standard headers
// they and the shipped kernels use (not jitk/tvm_ffi_types.h, which must follow the kernel
// files). jitk precompiles it once per compiler, flags and header
// set (jitk/build/pch.py), so a build parses none of it again.
#pragma once

#include <jitk/export.h>
#include <jitk/nvrtc.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
