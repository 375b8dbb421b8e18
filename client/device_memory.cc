#include "client/device_memory.h"

#include <algorithm>

namespace zeroshard {

PinnableBuffer::PinnableBuffer(size_t bytes) {
  constexpr size_t kPage = 4096;
  const size_t rounded = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
  data_.reset(static_cast<uint8_t*>(std::aligned_alloc(kPage, rounded)));
  if (data_ != nullptr) size_ = rounded;
}

absl::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCudaDevice:
      return "cuda_device";
  }
  return "unknown";
}

absl::Status FetchToDevice(DeviceCopier& device, uint8_t* bounce, size_t lane_bytes,
                           const FlatRange& range, size_t esize,
                           const std::function<absl::Status(const FlatRange&, void*)>& fetch,
                           void* dst, const std::function<absl::Time()>& deadline) {
  const uint64_t chunk = std::max<uint64_t>(1, lane_bytes / esize);
  absl::Status status;
  // Half i % kLanes receives chunk i while the other half's host-to-device
  // copy runs.
  uint64_t i = 0;
  for (uint64_t b = range.begin; b < range.end && status.ok(); b += chunk, ++i) {
    const int lane = static_cast<int>(i % DeviceCopier::kLanes);
    uint8_t* half = bounce + lane * lane_bytes;
    const FlatRange piece{b, std::min(range.end, b + chunk)};
    status = device.WaitLane(lane, deadline());
    if (status.ok()) status = fetch(piece, half);
    if (status.ok()) {
      status = device.FromHostAsync(half, static_cast<uint8_t*>(dst) + (b - range.begin) * esize,
                                    piece.size() * esize, lane);
    }
  }
  for (int lane = 0; lane < DeviceCopier::kLanes; ++lane) {
    absl::Status s = device.WaitLane(lane, deadline());
    if (status.ok()) status = s;
  }
  return status;
}

}  // namespace zeroshard
