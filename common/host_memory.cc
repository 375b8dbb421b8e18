#include "common/host_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>

namespace zeroshard {

void* AllocateHostArray(size_t bytes) {
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : 64;
  if (bytes == 0 || bytes > SIZE_MAX - align) return nullptr;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) return nullptr;
#if defined(MADV_HUGEPAGE)
  // Advice only: without THP (or with it "never") the pages stay 4 KiB.
  if (align == kHugePageBytes) ::madvise(p, rounded, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, rounded);
  return p;
}

}  // namespace zeroshard
