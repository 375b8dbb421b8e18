#include "transport/shm/push_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace zeroshard::transport {
namespace {

constexpr absl::string_view kNamePrefix = "zeroshard-push-";

std::string ErrnoText(int error) { return absl::StrCat(std::strerror(error), " (errno ", error, ")"); }

// Maps `bytes` of `fd` read-only at an address whose offset within a 2 MiB
// stretch differs from the previous mappings' (a page apart, cycling, never
// 0, where 2 MiB-aligned arrays start). The daemon sums several ranks' push
// memories at the same offsets in one pass, and memories mapped back to
// back, each a whole number of 2 MiB long, start at one offset within 2
// MiB: four 256 MiB memories so mapped were summed at 24-26 GB/s, the same
// four staggered by 4 KiB at 32-45 GB/s (the daemon's sum on 2 threads, on
// a 2-core AMD EPYC VM). Where a page is 2 MiB or more, a plain mapping.
// (Where shmem is given transparent huge pages, a staggered mapping still
// maps them a base page at a time.) MAP_FAILED with errno on failure.
void* MapStaggered(int fd, size_t bytes) {
  constexpr uintptr_t kStretch = uintptr_t{2} << 20;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  static std::atomic<uint64_t> next{0};
  const uintptr_t offsets = kStretch / page;  // page offsets within a stretch
  if (offsets < 2) return ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  const uintptr_t stagger =
      (next.fetch_add(1, std::memory_order_relaxed) % (offsets - 1) + 1) * page;
  const uintptr_t length = (bytes + page - 1) / page * page;
  // Room for the mapping wherever in the first stretch it starts.
  const uintptr_t span = length + 2 * kStretch;
  void* reserved =
      ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return MAP_FAILED;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t at = (begin + kStretch - 1) / kStretch * kStretch + stagger;
  void* data = ::mmap(reinterpret_cast<void*>(at), bytes, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    ::munmap(reserved, span);
    errno = error;
    return MAP_FAILED;
  }
  // The reservation around it goes back.
  if (at > begin) ::munmap(reserved, at - begin);
  if (begin + span > at + length) {
    ::munmap(reinterpret_cast<void*>(at + length), begin + span - (at + length));
  }
  return data;
}

// "zeroshard-push-" and 32 hex digits of getrandom().
absl::StatusOr<std::string> SecretName() {
  char secret[16];
  size_t got = 0;
  while (got < sizeof(secret)) {
    const ssize_t n = ::getrandom(secret + got, sizeof(secret) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("push memory: getrandom for its name: ", ErrnoText(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::StrCat(kNamePrefix, absl::BytesToHexString(absl::string_view(secret, sizeof(secret))));
}

// The mount id in a /proc/.../fdinfo/N file (a procfs read: whatever the
// descriptor is, its filesystem is not asked anything); -1 when unreadable.
int64_t MountIdOf(const std::string& fdinfo) {
  const int fd = ::open(fdinfo.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[1024];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return -1;
  text[n] = '\0';
  const char* at = std::strstr(text, "mnt_id:");
  if (at == nullptr) return -1;
  char* end = nullptr;
  const long long id = std::strtoll(at + 7, &end, 10);
  return end == at + 7 ? -1 : id;
}

// The kernel's internal shared-memory mount, where every memfd lives
// (learned once from a memfd of this process's own); -1 when unknown.
int64_t ShmMountId() {
  static const int64_t id = [] {
    const int fd = ::memfd_create("zeroshard-probe", MFD_CLOEXEC);
    if (fd < 0) return int64_t{-1};
    const int64_t mount = MountIdOf(absl::StrCat("/proc/self/fdinfo/", fd));
    ::close(fd);
    return mount;
  }();
  return id;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PushMemory>> PushMemory::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("push memory: 0 bytes");
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (bytes > SIZE_MAX - page) return absl::InvalidArgumentError("push memory: too large");
  const size_t size = (bytes + page - 1) / page * page;
  absl::StatusOr<std::string> name = SecretName();
  if (!name.ok()) return name.status();
  int fd = -1;
#ifdef MFD_NOEXEC_SEAL
  // Where vm.memfd_noexec asks for it; kernels before 6.3 refuse the flag.
  fd = ::memfd_create(name->c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
#endif
  if (fd < 0) fd = ::memfd_create(name->c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("push memory: memfd_create: ", ErrnoText(errno)));
  }
  auto fail = [&](absl::string_view what) {
    const int error = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("push memory of ", size, " bytes: ", what, ": ", ErrnoText(error)));
  };
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return fail("ftruncate");
  // Sealed before anyone else can open it: its size is fixed for good.
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("F_ADD_SEALS");
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return fail("mmap");
  return std::unique_ptr<PushMemory>(new PushMemory(data, size, fd, *std::move(name)));
}

PushMemory::PushMemory(void* data, size_t size, int fd, std::string name)
    : data_(data), size_(size), fd_(fd), pid_(::getpid()), name_(std::move(name)) {}

PushMemory::~PushMemory() {
  ::munmap(data_, size_);
  ::close(fd_);
}

bool PushMemory::Contains(const void* p, size_t n, uint64_t* offset) const {
  const auto at = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(data_);
  if (at < base || at - base > size_ || n > size_ - (at - base)) return false;
  *offset = at - base;
  return true;
}

absl::StatusOr<std::unique_ptr<PeerMemory>> PeerMemory::Open(int64_t pid, int64_t fd,
                                                             absl::string_view name,
                                                             uint64_t bytes) {
  if (pid <= 0 || pid > INT32_MAX || fd < 0 || fd > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("push memory: pid ", pid, " or fd ", fd, " out of range"));
  }
  if (bytes == 0 || bytes > kMaxPushMemoryBytes) {
    return absl::InvalidArgumentError(absl::StrCat("push memory: bytes must be in 1..",
                                                   kMaxPushMemoryBytes, ", got ", bytes));
  }
  if (name.size() > kMaxPushMemoryName || name.substr(0, kNamePrefix.size()) != kNamePrefix ||
      name.find_first_of(absl::string_view("/\0 ", 3)) != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("push memory: a name \"", kNamePrefix, "...\" of at most ",
                     kMaxPushMemoryName, " characters without '/', NUL or space"));
  }
  const std::string where = absl::StrCat("push memory (fd ", fd, " of process ", pid, ")");
  // Only a descriptor on the shared-memory mount is taken: closing a
  // descriptor of another filesystem (FUSE) may wait on that filesystem.
  const int64_t shm = ShmMountId();
  const int64_t mount = MountIdOf(absl::StrCat("/proc/", pid, "/fdinfo/", fd));
  if (shm < 0 || mount != shm) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": ", mount < 0 ? "cannot read its fdinfo" : "is not a memfd",
        " (the trainer runs on another host or in another pid namespace, this daemon may not "
        "see its files, or the descriptor is not its push memory)"));
  }
  // The trainer's open file itself, duplicated: nothing is opened by path
  // (no filesystem is asked anything, whatever the descriptor names).
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": pidfd_open: ", ErrnoText(errno),
        " (the trainer runs on another host or in another pid namespace)"));
  }
  const int own = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, static_cast<int>(fd), 0));
  const int got_errno = errno;
  ::close(pidfd);
  if (own < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": pidfd_getfd: ", ErrnoText(got_errno),
        " (this daemon may not take the trainer's files: it needs the right to ptrace it, "
        "e.g. the same user; or no such descriptor)"));
  }
  if (MountIdOf(absl::StrCat("/proc/self/fdinfo/", own)) != shm) {
    // Swapped since the check: let go of it on a thread of its own, which
    // a filesystem that never answers the close may keep.
    std::thread([own] { ::close(own); }).detach();
    return absl::FailedPreconditionError(absl::StrCat(where, ": is not a memfd"));
  }
  auto refuse = [&](absl::string_view why) {
    ::close(own);
    return absl::FailedPreconditionError(absl::StrCat(where, ": ", why));
  };
  // Only shmem and hugetlbfs files carry seals; tmpfs alone (a hugetlbfs
  // file can lose its pages to a hole punched in it, and reads then fault).
  const int seals = ::fcntl(own, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) return refuse("is not sealed against shrinking");
  struct statfs fs;
  if (::fstatfs(own, &fs) != 0 || fs.f_type != TMPFS_MAGIC) return refuse("is not on tmpfs");
  const std::string self = absl::StrCat("/proc/self/fd/", own);
  char link[256];
  const ssize_t n = ::readlink(self.c_str(), link, sizeof(link));
  if (n < 0 || absl::string_view(link, static_cast<size_t>(n)) !=
                   absl::StrCat("/memfd:", name, " (deleted)")) {
    return refuse(absl::StrCat("is not the memfd \"", name, "\""));
  }
  struct stat st;
  if (::fstat(own, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0 ||
      static_cast<uint64_t>(st.st_size) < bytes) {
    return refuse(absl::StrCat("is shorter than ", bytes, " bytes"));
  }
  void* data = MapStaggered(own, bytes);
  const int map_errno = errno;
  ::close(own);
  if (data == MAP_FAILED) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": mmap of ", bytes, " bytes: ", ErrnoText(map_errno)));
  }
  return std::unique_ptr<PeerMemory>(new PeerMemory(data, bytes));
}

PeerMemory::~PeerMemory() { ::munmap(const_cast<void*>(data_), size_); }

}  // namespace zeroshard::transport
