#pragma once

// Trainer buffers in CUDA device memory. The client never guesses where a
// buffer lives: every call that takes one says so with a MemoryKind, and a
// device buffer is only accepted by a client created with
// ClientConfig::cuda_device set.
//
// A DeviceCopier moves bytes between the device and host buffers the client
// owns (its gradient staging pool, its gather bounce buffers), which it pins
// once so that the copies are DMA transfers. Copies run on one dedicated
// CUDA stream of the copier; dtype casts (fp32 <-> bf16/fp16) run on the
// device (cuda/cuda_ops.h), so only wire-sized bytes cross the bus. The
// stream is a blocking one: its copies wait for work queued before them on
// the legacy default stream (stream 0, PyTorch's default stream) and such
// later work waits for them; work on other streams must be finished by the
// caller before a buffer is handed over. Calls leave the calling thread's
// current CUDA device as they found it.
//
// Built with CUDA when nvcc was found at build time (third_party/cuda);
// without it, or without a device at run time, CreateDeviceCopier answers
// FailedPrecondition saying which.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/flat_range.h"

namespace zeroshard {

enum class MemoryKind {
  kHost,        // pageable or pinned host memory
  kCudaDevice,  // memory of ClientConfig::cuda_device (cudaMalloc)
};

absl::string_view MemoryKindName(MemoryKind kind);

// Host memory allocated page-aligned and rounded up to whole pages, for a
// buffer allocated once that a DeviceCopier may pin (pinning takes whole
// pages, so no other allocation may share them). data() is null when the
// allocation failed.
class PinnableBuffer {
 public:
  PinnableBuffer() = default;
  explicit PinnableBuffer(size_t bytes);
  uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0;
};

// Thread-safe: copies from several threads are serialised on the copier's
// stream. Every blocking call waits until its deadline; a copy still running
// then is waited for anyway (with a message on stderr every few seconds)
// before the call returns, since it still writes the caller's buffer.
class DeviceCopier {
 public:
  // Completion lanes of FromHostAsync: a caller double-buffers with two.
  static constexpr int kLanes = 2;

  virtual ~DeviceCopier() = default;

  // The device this copier copies to and from.
  virtual int device() const = 0;

  // Whether [p, p + bytes) is memory of this copier's device (its first and
  // last byte): InvalidArgument naming `what` otherwise (a host pointer,
  // another device's memory).
  virtual absl::Status CheckDevicePointer(const void* p, size_t bytes,
                                          absl::string_view what) const = 0;

  // host_dst (n elements of dst_dtype) = device_src (n elements of
  // src_dtype). fp32 -> bf16/fp16 is packed on the device before the copy,
  // bf16/fp16 -> fp32 unpacked on the device; other pairs of different
  // dtypes are InvalidArgument. Blocks until the bytes are in host_dst.
  // Internal (with CUDA's message) when CUDA fails.
  virtual absl::Status ToHost(const void* device_src, DType src_dtype, void* host_dst,
                              DType dst_dtype, size_t n, absl::Time deadline) = 0;

  // Enqueues device_dst = host_src (`bytes`) on the copier's stream and
  // returns; `lane` (0..kLanes-1) completes when the copy has. host_src must
  // stay unchanged and allocated until WaitLane(lane) returns.
  virtual absl::Status FromHostAsync(const void* host_src, void* device_dst, size_t bytes,
                                     int lane) = 0;
  // Blocks until every copy enqueued on `lane` so far has completed.
  virtual absl::Status WaitLane(int lane, absl::Time deadline) = 0;

  // Page-locks `bytes` of host memory at `p` for DMA (cudaHostRegister), for
  // buffers allocated once; Unpin before freeing them.
  virtual absl::Status Pin(void* p, size_t bytes) = 0;
  virtual void Unpin(void* p) = 0;
};

// Fills device memory `dst` with flat `range` (elements of `esize` bytes):
// `fetch(piece, out)` writes each piece into one of kLanes pinned host
// halves of `bounce` (`lane_bytes` each), and the piece's copy to the
// device overlaps the next fetch. Returns the first error once nothing
// writes `dst` any more (errors included); each copy wait ends at the time
// `deadline()` returns when the wait starts, as DeviceCopier's waits do.
absl::Status FetchToDevice(DeviceCopier& device, uint8_t* bounce, size_t lane_bytes,
                           const FlatRange& range, size_t esize,
                           const std::function<absl::Status(const FlatRange&, void*)>& fetch,
                           void* dst, const std::function<absl::Time()>& deadline);

// A copier for CUDA device `device` (its own stream, events and a device
// scratch buffer of at most `scratch_bytes` for the casts, all allocated
// here). FailedPrecondition when this build has no CUDA, when there is no
// such device, or when the driver refuses (CUDA's message included).
absl::StatusOr<std::unique_ptr<DeviceCopier>> CreateDeviceCopier(int device, size_t scratch_bytes);

// Whether this build can use CUDA devices at all (nvcc was found).
bool BuiltWithCuda();

}  // namespace zeroshard
