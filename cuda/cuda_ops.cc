#include "cuda/cuda_ops.h"

#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace zeroshard::cuda_internal {
cudaError_t LaunchToBf16(const float* src, void* dst, size_t n, cudaStream_t stream);
cudaError_t LaunchToHalf(const float* src, void* dst, size_t n, cudaStream_t stream);
cudaError_t LaunchFromBf16(const void* src, float* dst, size_t n, cudaStream_t stream);
cudaError_t LaunchFromHalf(const void* src, float* dst, size_t n, cudaStream_t stream);
cudaError_t LaunchUnscale(float* grads, size_t n, float inv_scale, int* found_inf,
                          cudaStream_t stream);
cudaError_t LaunchAddFloat(const void* src, float* dst, size_t n, cudaStream_t stream);
cudaError_t LaunchAddBf16(const void* src, float* dst, size_t n, cudaStream_t stream);
cudaError_t LaunchAddHalf(const void* src, float* dst, size_t n, cudaStream_t stream);
}  // namespace zeroshard::cuda_internal

namespace zeroshard::cuda {

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(e)));
}

DeviceScope::DeviceScope(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ != device && cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
}

DeviceScope::~DeviceScope() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    cudaSetDevice(previous_);
  }
}

void PollPause(int spins) {
  if (spins < 64) {
    std::this_thread::yield();
  } else {
    absl::SleepFor(absl::Microseconds(50));
  }
}

absl::StatusOr<bool> WaitForEvent(cudaEvent_t event, absl::Time deadline, absl::string_view what) {
  absl::Time next_warning = deadline;
  bool late = false;
  for (int spins = 0;; ++spins) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return late;
    if (e != cudaErrorNotReady) return CudaStatus(e, what);
    const absl::Time now = absl::Now();
    if (now >= next_warning) {
      late = true;
      int device = -1;
      if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
      std::fprintf(stderr,
                   "zeroshard client: CUDA device %d: a %.*s is still running past its "
                   "deadline; waiting for it\n",
                   device, static_cast<int>(what.size()), what.data());
      next_warning = now + absl::Seconds(5);
    }
    PollPause(spins);
  }
}

absl::StatusOr<int> DeviceCount() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("no CUDA device: ", cudaGetErrorString(e)));
  }
  if (n == 0) return absl::UnavailableError("no CUDA device visible");
  return n;
}

absl::Status PackFromFloat(const float* src, void* dst, DType to, size_t n, cudaStream_t stream) {
  switch (to) {
    case DType::kBf16:
      return CudaStatus(cuda_internal::LaunchToBf16(src, dst, n, stream), "pack bf16");
    case DType::kFp16:
      return CudaStatus(cuda_internal::LaunchToHalf(src, dst, n, stream), "pack fp16");
    case DType::kFp32:
      return CudaStatus(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, stream), "copy");
  }
  return absl::InvalidArgumentError("to: unknown dtype");
}

absl::Status UnpackToFloat(const void* src, DType from, float* dst, size_t n,
                           cudaStream_t stream) {
  switch (from) {
    case DType::kBf16:
      return CudaStatus(cuda_internal::LaunchFromBf16(src, dst, n, stream), "unpack bf16");
    case DType::kFp16:
      return CudaStatus(cuda_internal::LaunchFromHalf(src, dst, n, stream), "unpack fp16");
    case DType::kFp32:
      return CudaStatus(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, stream), "copy");
  }
  return absl::InvalidArgumentError("from: unknown dtype");
}

absl::Status AddIntoFloat(const void* src, DType from, float* dst, size_t n, cudaStream_t stream) {
  switch (from) {
    case DType::kFp32:
      return CudaStatus(cuda_internal::LaunchAddFloat(src, dst, n, stream), "add fp32");
    case DType::kBf16:
      return CudaStatus(cuda_internal::LaunchAddBf16(src, dst, n, stream), "add bf16");
    case DType::kFp16:
      return CudaStatus(cuda_internal::LaunchAddHalf(src, dst, n, stream), "add fp16");
  }
  return absl::InvalidArgumentError("from: unknown dtype");
}

absl::StatusOr<bool> UnscaleAndCheckOverflow(float* grads, size_t n, float loss_scale, int* flag,
                                             cudaStream_t stream) {
  if (!(loss_scale > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("loss_scale: must be > 0, got ", loss_scale));
  }
  if (absl::Status s = CudaStatus(cudaMemsetAsync(flag, 0, sizeof(int), stream), "clear flag");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(
          cuda_internal::LaunchUnscale(grads, n, 1.0f / loss_scale, flag, stream), "unscale");
      !s.ok()) {
    return s;
  }
  int host = 0;
  if (absl::Status s = CudaStatus(
          cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream), "read flag");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaStreamSynchronize(stream), "synchronize"); !s.ok()) return s;
  return host != 0;
}

}  // namespace zeroshard::cuda
