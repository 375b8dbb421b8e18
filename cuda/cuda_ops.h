#pragma once

// The trainer's GPU helpers: pack fp32 to bf16/fp16 and back (the wire types
// of gradients and gathered parameters), and unscale gradients while checking
// for overflow (dynamic loss scaling). Every call checks its CUDA result and
// clears the sticky error state; none throws. Calls launch on `stream` and do
// not synchronise unless they say so. Device pointers are the caller's.

#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/dtype.h"

namespace zeroshard::cuda {

// CUDA's result as a Status: OK, or Internal naming `what` with CUDA's
// message. Clears the sticky error so that later calls are not blamed.
absl::Status CudaStatus(cudaError_t e, absl::string_view what);

// The pause between two polls of device work: yields for the first 64
// polls (work of microseconds), then sleeps 50 us each time.
void PollPause(int spins);

// Polls `event` until it has completed. Past `deadline` it keeps waiting
// (the work still uses the caller's buffers) and says so on stderr every
// 5 s, naming `what` and the current device. Returns whether it ran past
// the deadline, or CUDA's error (Internal, naming `what`).
absl::StatusOr<bool> WaitForEvent(cudaEvent_t event, absl::Time deadline, absl::string_view what);

// Makes `device` the calling thread's current CUDA device for the scope and
// then puts the previous one back: the trainer's threads keep theirs.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// Number of visible CUDA devices; Unavailable (with CUDA's message) when there
// is no driver or no device, so GPU code paths can be skipped cleanly.
absl::StatusOr<int> DeviceCount();

// dst (n elements of `to`, bf16 or fp16) = src (fp32), round to nearest even.
absl::Status PackFromFloat(const float* src, void* dst, DType to, size_t n, cudaStream_t stream);
// dst (fp32) = src (n elements of `from`, bf16 or fp16).
absl::Status UnpackToFloat(const void* src, DType from, float* dst, size_t n,
                           cudaStream_t stream);

// dst[i] += src[i] (n elements of `from`: fp32, bf16 or fp16), in fp32.
absl::Status AddIntoFloat(const void* src, DType from, float* dst, size_t n, cudaStream_t stream);

// grads *= 1 / loss_scale in place; returns whether any result is inf/nan.
// Synchronises `stream` to read the flag. `flag` is a device int the caller
// owns (allocated once, reused).
absl::StatusOr<bool> UnscaleAndCheckOverflow(float* grads, size_t n, float loss_scale, int* flag,
                                             cudaStream_t stream);

}  // namespace zeroshard::cuda
