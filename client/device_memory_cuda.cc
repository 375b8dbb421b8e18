// DeviceCopier over the CUDA runtime: one non-blocking stream per copier,
// an event per completion lane, a device scratch buffer for the casts.

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/device_memory.h"
#include "common/status_macros.h"
#include "cuda/cuda_ops.h"

namespace zeroshard {
namespace {

using cuda::DeviceScope;

using cuda::CudaStatus;

// In a CudaCopier member: returns the CUDA error of `call` after letting the stream drain (so that
// no enqueued copy still writes a caller's buffer).
#define RETURN_CUDA(call, what)                                                     \
  do {                                                                              \
    if (absl::Status s_ = CudaStatus((call), (what)); !s_.ok()) return Drained(s_); \
  } while (0)

class CudaCopier final : public DeviceCopier {
 public:
  ~CudaCopier() override {
    DeviceScope scope(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : lanes_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  static absl::StatusOr<std::unique_ptr<DeviceCopier>> Create(int device, size_t scratch_bytes) {
    absl::StatusOr<int> count = cuda::DeviceCount();
    if (!count.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA device ", device, ": ", count.status().message()));
    }
    if (device < 0 || device >= *count) {
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA device ", device, ": this machine has devices 0..", *count - 1));
    }
    std::unique_ptr<CudaCopier> c(new CudaCopier(device));
    auto refused = [&](const absl::Status& s) {
      return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, ": ", s.message()));
    };
    DeviceScope scope(device);
    // A blocking stream: ordered with the legacy default stream's work.
    if (absl::Status s = CudaStatus(cudaStreamCreate(&c->stream_), "stream"); !s.ok()) {
      return refused(s);
    }
    for (cudaEvent_t& e : c->lanes_) {
      if (absl::Status s =
              CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
          !s.ok()) {
        return refused(s);
      }
    }
    if (absl::Status s =
            CudaStatus(cudaEventCreateWithFlags(&c->done_, cudaEventDisableTiming), "event");
        !s.ok()) {
      return refused(s);
    }
    c->scratch_bytes_ = std::max<size_t>(scratch_bytes, 4096) & ~size_t{7};
    if (absl::Status s =
            CudaStatus(cudaMalloc(&c->scratch_, c->scratch_bytes_), "cudaMalloc scratch");
        !s.ok()) {
      return refused(s);
    }
    return std::unique_ptr<DeviceCopier>(std::move(c));
  }

  int device() const override { return device_; }

  absl::Status CheckDevicePointer(const void* p, size_t bytes,
                                  absl::string_view what) const override {
    RETURN_IF_ERROR(CheckOnePointer(p, what));
    if (bytes > 1) {
      RETURN_IF_ERROR(CheckOnePointer(static_cast<const uint8_t*>(p) + bytes - 1,
                                      absl::StrCat(what, " (its last byte)")));
    }
    return absl::OkStatus();
  }

  absl::Status CheckOnePointer(const void* p, absl::string_view what) const {
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": not CUDA device memory (cudaPointerGetAttributes: ", cudaGetErrorString(e),
          ")"));
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       ": not CUDA device memory (it is host memory); pass "
                       "MemoryKind::kHost for host buffers"));
    }
    if (attr.device != device_) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": memory of CUDA device ", attr.device,
                                                     ", this client uses device ", device_));
    }
    return absl::OkStatus();
  }

  absl::Status ToHost(const void* device_src, DType src_dtype, void* host_dst, DType dst_dtype,
                      size_t n, absl::Time deadline) override {
    const size_t src_size = DTypeSize(src_dtype), dst_size = DTypeSize(dst_dtype);
    const bool pack = src_dtype == DType::kFp32 && dst_dtype != DType::kFp32;
    const bool unpack = src_dtype != DType::kFp32 && dst_dtype == DType::kFp32;
    if (src_dtype != dst_dtype && !pack && !unpack) {
      return absl::InvalidArgumentError(absl::StrCat("device copy from ", DTypeName(src_dtype),
                                                     " to ", DTypeName(dst_dtype),
                                                     ": only fp32 <-> bf16/fp16 cast"));
    }
    absl::MutexLock lock(&mu_);
    DeviceScope scope(device_);
    const auto* src = static_cast<const uint8_t*>(device_src);
    auto* dst = static_cast<uint8_t*>(host_dst);
    if (src_dtype == dst_dtype) {
      RETURN_CUDA(cudaMemcpyAsync(dst, src, n * src_size, cudaMemcpyDeviceToHost, stream_),
                  "device-to-host copy");
    } else {
      // Cast into the scratch buffer, then copy the cast bytes out; the
      // stream orders each chunk's cast after the previous chunk's copy.
      const size_t per_chunk = scratch_bytes_ / std::max(src_size, dst_size);
      for (size_t i = 0; i < n; i += per_chunk) {
        const size_t m = std::min(per_chunk, n - i);
        absl::Status s = pack ? cuda::PackFromFloat(reinterpret_cast<const float*>(src) + i,
                                                    scratch_, dst_dtype, m, stream_)
                              : cuda::UnpackToFloat(src + i * src_size, src_dtype,
                                                    static_cast<float*>(scratch_), m, stream_);
        if (!s.ok()) return Drained(s);
        RETURN_CUDA(cudaMemcpyAsync(dst + i * dst_size, scratch_, m * dst_size,
                                    cudaMemcpyDeviceToHost, stream_),
                    "device-to-host copy");
      }
    }
    RETURN_CUDA(cudaEventRecord(done_, stream_), "cudaEventRecord");
    return Await(done_, deadline, "device-to-host copy");
  }

  absl::Status FromHostAsync(const void* host_src, void* device_dst, size_t bytes,
                             int lane) override {
    if (lane < 0 || lane >= kLanes) {
      return absl::InvalidArgumentError(absl::StrCat("lane: must be < ", kLanes, ", got ", lane));
    }
    absl::MutexLock lock(&mu_);
    DeviceScope scope(device_);
    RETURN_CUDA(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, stream_),
                "host-to-device copy");
    RETURN_CUDA(cudaEventRecord(lanes_[lane], stream_), "cudaEventRecord");
    return absl::OkStatus();
  }

  absl::Status WaitLane(int lane, absl::Time deadline) override {
    if (lane < 0 || lane >= kLanes) {
      return absl::InvalidArgumentError(absl::StrCat("lane: must be < ", kLanes, ", got ", lane));
    }
    DeviceScope scope(device_);
    return Await(lanes_[lane], deadline, "host-to-device copy");
  }

  absl::Status Pin(void* p, size_t bytes) override {
    DeviceScope scope(device_);
    return CudaStatus(cudaHostRegister(p, bytes, cudaHostRegisterDefault), "cudaHostRegister");
  }
  void Unpin(void* p) override {
    DeviceScope scope(device_);
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
  }

 private:
  explicit CudaCopier(int device) : device_(device) {}

  // `s`, once every copy enqueued so far has ended (or failed).
  absl::Status Drained(absl::Status s) {
    if (stream_ != nullptr && cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
    return s;
  }

  // Waits for `event` (cuda::WaitForEvent): DeadlineExceeded when it
  // completed past `deadline`.
  absl::Status Await(cudaEvent_t event, absl::Time deadline, absl::string_view what) {
    ASSIGN_OR_RETURN(const bool late, cuda::WaitForEvent(event, deadline, what));
    if (late) return absl::DeadlineExceededError(absl::StrCat(what, " ran past its deadline"));
    return absl::OkStatus();
  }

  const int device_;
  // Serialises the enqueueing of copies and the scratch buffer's use.
  absl::Mutex mu_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t lanes_[kLanes] = {};
  cudaEvent_t done_ = nullptr;  // ToHost's completion (used under mu_)
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

#undef RETURN_CUDA

}  // namespace

bool BuiltWithCuda() { return true; }

absl::StatusOr<std::unique_ptr<DeviceCopier>> CreateDeviceCopier(int device, size_t scratch_bytes) {
  return CudaCopier::Create(device, scratch_bytes);
}

}  // namespace zeroshard
