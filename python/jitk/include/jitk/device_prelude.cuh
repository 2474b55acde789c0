// What every device half (a kernel file's device side, built by NVRTC, jitk/nvrtc.cuh) reads
// before its kernel files: jitk's device headers and, through jitk/packed.cuh, CUDA's fp16
// and bf16 types. NVRTC precompiles it once a process for each target and set of options
// (jitk/build/device_prelude.py), so a build loads these instead of parsing them again; the
// same file is read as text where that precompiled header is not there.
#pragma once

#include <jitk/device.cuh>
#include <jitk/nvrtc.cuh>
#include <jitk/packed.cuh>
#include <jitk/utils.cuh>
