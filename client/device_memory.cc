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

}  // namespace zeroshard
