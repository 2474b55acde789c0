// Issue #38: a kernel compiled by NVRTC, launched from plain g++ host code by its lowered
// name (no nvcc in the host build), against the same kernel compiled by nvcc: results and
// kernel time. Build (no GPU needed):
//   g++ -std=c++20 -O2 -I/usr/local/cuda/include exp_nvrtc_launch.cpp \
//       -L/usr/local/cuda/lib64 -lcudart_static -ldl -lpthread -lrt -o exp_nvrtc_launch
// Run: exp_nvrtc_launch nvrtc.cubin NAME nvcc.cubin NAME (the cubins and names that
// exp_nvrtc_split.py --nvdisasm PATH --keep DIR prints and keeps)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <vector>

#define CHECK(call)                                                                             \
  do {                                                                                          \
    cudaError_t e = (call);                                                                     \
    if (e != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

static cudaKernel_t load(const char* path, const char* name) {
  std::ifstream file(path, std::ios::binary);
  std::vector<char> image((std::istreambuf_iterator<char>(file)), {});
  cudaLibrary_t library = nullptr;
  CHECK(cudaLibraryLoadData(&library, image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  cudaKernel_t kernel = nullptr;
  CHECK(cudaLibraryGetKernel(&kernel, library, name));
  return kernel;
}

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const long long n = 1LL << 26;
  const int threads = 256;
  float *x = nullptr, *y = nullptr;
  CHECK(cudaMalloc(&x, n * sizeof(float)));
  CHECK(cudaMalloc(&y, n * sizeof(float)));
  std::vector<float> hx(n), hy(n), out(n);
  for (long long i = 0; i < n; ++i) hx[i] = float(i % 1000) * 0.5f, hy[i] = float(i % 7);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int which = 0; which < 2; ++which) {
    const char* label = which == 0 ? "nvrtc" : "nvcc";
    cudaKernel_t kernel = load(argv[1 + 2 * which], argv[2 + 2 * which]);
    float alpha = 2.0f;
    void* args[] = {&alpha, &x, &y, const_cast<long long*>(&n)};
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(unsigned((n + threads - 1) / threads));
    config.blockDim = dim3(threads);
    CHECK(cudaMemcpy(x, hx.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, hy.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(kernel), args));
    CHECK(cudaMemcpy(out.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost));
    long long wrong = 0;
    for (long long i = 0; i < n; ++i) wrong += out[i] != alpha * hx[i] + hy[i];
    std::vector<float> ms;
    for (int rep = 0; rep < 50; ++rep) {
      CHECK(cudaEventRecord(start));
      CHECK(cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(kernel), args));
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("%s: wrong elements %lld, kernel median %.1f us (min %.1f, max %.1f)\n", label,
                wrong, ms[ms.size() / 2] * 1e3, ms.front() * 1e3, ms.back() * 1e3);
  }
  return 0;
}
