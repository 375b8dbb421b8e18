// Device kernels behind cuda_ops.h. Plain CUDA C++ (no Abseil): every entry
// point launches on `stream` and returns the launch's cudaError_t; the caller
// converts it to absl::Status.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace zeroshard::cuda_internal {
namespace {

constexpr int kThreads = 256;

int Blocks(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b > 65535 ? 65535 : (b == 0 ? 1 : b));
}

__global__ void ToBf16Kernel(const float* src, __nv_bfloat16* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void ToHalfKernel(const float* src, __half* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    dst[i] = __float2half_rn(src[i]);
  }
}

__global__ void FromBf16Kernel(const __nv_bfloat16* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

__global__ void FromHalfKernel(const __half* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    dst[i] = __half2float(src[i]);
  }
}

// dst[i] += float(src[i]), summed in fp32 (as the daemons and the Gloo
// collective sum contributions).
template <typename T>
__device__ float AsFloat(T v);
template <>
__device__ float AsFloat<float>(float v) {
  return v;
}
template <>
__device__ float AsFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ float AsFloat<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__global__ void AddIntoFloatKernel(const T* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    dst[i] += AsFloat<T>(src[i]);
  }
}

// grads[i] *= inv_scale; *found_inf = 1 if any result is inf or nan (as
// torch's _amp_foreach_non_finite_check_and_unscale_).
__global__ void UnscaleKernel(float* grads, size_t n, float inv_scale, int* found_inf) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    const float v = grads[i] * inv_scale;
    if (!isfinite(v)) *found_inf = 1;
    grads[i] = v;
  }
}

}  // namespace

cudaError_t LaunchToBf16(const float* src, void* dst, size_t n, cudaStream_t stream) {
  ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  return cudaGetLastError();
}

cudaError_t LaunchToHalf(const float* src, void* dst, size_t n, cudaStream_t stream) {
  ToHalfKernel<<<Blocks(n), kThreads, 0, stream>>>(src, static_cast<__half*>(dst), n);
  return cudaGetLastError();
}

cudaError_t LaunchFromBf16(const void* src, float* dst, size_t n, cudaStream_t stream) {
  FromBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), dst,
                                                     n);
  return cudaGetLastError();
}

cudaError_t LaunchFromHalf(const void* src, float* dst, size_t n, cudaStream_t stream) {
  FromHalfKernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const __half*>(src), dst, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddFloat(const void* src, float* dst, size_t n, cudaStream_t stream) {
  AddIntoFloatKernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const float*>(src), dst, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddBf16(const void* src, float* dst, size_t n, cudaStream_t stream) {
  AddIntoFloatKernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src),
                                                         dst, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddHalf(const void* src, float* dst, size_t n, cudaStream_t stream) {
  AddIntoFloatKernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const __half*>(src), dst, n);
  return cudaGetLastError();
}

cudaError_t LaunchUnscale(float* grads, size_t n, float inv_scale, int* found_inf,
                          cudaStream_t stream) {
  UnscaleKernel<<<Blocks(n), kThreads, 0, stream>>>(grads, n, inv_scale, found_inf);
  return cudaGetLastError();
}

}  // namespace zeroshard::cuda_internal
