#include "client/device_memory.h"

namespace zeroshard {

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
