#pragma once

// Host memory for large arrays that are swept end to end: a daemon's model
// states and gradients (LedgerArray; the regions a bulk transport serves,
// such as staging slots, come from the transport), and the benchmarks'
// buffers of the same sizes (so their rooflines run on the same kind of
// pages).

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace zeroshard {

// A transparent huge page on x86-64 and arm64 with 4 KiB base pages.
inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Zero-filled memory for `bytes` (> 0), 64-byte aligned, or null when the
// process is out of memory. An array of at least kHugePageBytes is aligned
// to kHugePageBytes and its whole 2 MiB pages are advised MADV_HUGEPAGE
// before they are first touched, so that where transparent huge pages are
// "always" or "madvise" (not "never") the kernel backs them with 2 MiB
// pages: a sweep over it then walks 512 times fewer page-table entries. Its
// tail, less than 2 MiB, stays on 4 KiB pages: nothing past `bytes` (in 4
// KiB pages) is touched. Free it with std::free.
void* AllocateHostArray(size_t bytes);

// An array of `n` T from AllocateHostArray, freed with it.
template <typename T>
struct HostArray {
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  // Null data when out of memory.
  explicit HostArray(size_t n) : data(static_cast<T*>(AllocateHostArray(n * sizeof(T)))) {}
  T* get() const { return data.get(); }
  std::unique_ptr<T, Free> data;
};

}  // namespace zeroshard
