#pragma once
#include <jitk/nvrtc.cuh>
#include <jitk/utils.cuh>
#include <jitk/device.cuh>
#include <jitk/packed.cuh>
