#include "common/host_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace zeroshard {

void* AllocateHostArray(size_t bytes) {
  if (bytes == 0) return nullptr;
  const bool huge = bytes >= kHugePageBytes;
  void* p = nullptr;
  if (::posix_memalign(&p, huge ? kHugePageBytes : 64, bytes) != 0) return nullptr;
#if defined(MADV_HUGEPAGE)
  // Advice only (without THP, or with it "never", the pages stay 4 KiB), and
  // for whole huge pages only: the tail stays on 4 KiB pages, so no more
  // memory is touched than `bytes` (rounded to 4 KiB), as the ledger books.
  if (huge) ::madvise(p, bytes / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, bytes);
  return p;
}

}  // namespace zeroshard
