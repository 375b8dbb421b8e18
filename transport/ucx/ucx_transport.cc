#include "transport/ucx/ucx_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/fnv.h"
#include "transport/piece_plan.h"
#include "transport/ucx/ucx_tls.h"
#include "transport/ucx/ucx_wire.h"

namespace zeroshard::transport::ucx {
namespace {

// How long teardown waits for UCX to finish closing endpoints.
constexpr absl::Duration kCloseWait = absl::Seconds(2);
// Empty progress rounds (each yields the CPU) after the last event before a
// worker sleeps on its event fd: about 0.1-0.2 ms. Kept short because on a
// host with few cores a spinning progress thread takes the CPU from the
// threads doing the copies it waits for (2000 rounds cost a third of the
// push bandwidth of bench/transport_bench on 2 cores).
constexpr int kSpinRounds = 100;
// How often a process on this host is checked for being alive, when UCX
// cannot report its death (see PeerIdentity).
constexpr absl::Duration kLivenessInterval = absl::Milliseconds(100);

std::string UcsText(ucs_status_t status) { return ucs_status_string(status); }

// UCX 1.13's shared-memory transports cannot carry an endpoint with peer
// error handling (ucp_ep_create fails with "no peer failure handler"). When
// UCX_TLS names nothing else, endpoints are created without it, and a dead
// peer is noticed by the failing transfer instead (cma reports it at once).
bool WantsPeerErrorMode(absl::string_view tls) {
  if (tls.empty()) return true;
  static const char* const kSharedMemoryOnly[] = {
      "posix", "sysv", "xpmem", "knem", "cma", "self", "sm", "shm", "mm"};
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    name = absl::StripAsciiWhitespace(name);
    if (!name.empty() && name[0] == '^') return true;  // exclusion list
    bool shared_memory = false;
    for (const char* known : kSharedMemoryOnly) shared_memory |= name == known;
    if (!shared_memory) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// Who a peer is (PeerIdentity, carried in its address: ucx_wire.h), for
// noticing its death where UCX cannot: endpoints without peer error handling
// (shared memory only) to a process on this host.

// Clock ticks since boot at which `pid` started; 0 if it does not exist.
uint64_t ProcessStartTime(uint32_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%u/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char buffer[1024];
  const size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  buffer[n] = '\0';
  // Fields after the parenthesised command name start with field 3 (state);
  // the start time is field 22.
  const char* p = std::strrchr(buffer, ')');
  if (p == nullptr) return 0;
  int field = 2;
  for (++p; *p != '\0'; ++p) {
    if (*p == ' ') {
      ++field;
      if (field == 22) return std::strtoull(p + 1, nullptr, 10);
    }
  }
  return 0;
}

uint64_t BootHash() {
  static const uint64_t hash = [] {
    std::string id;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char buffer[128];
      id.assign(buffer, std::fread(buffer, 1, sizeof(buffer), f));
      std::fclose(f);
    }
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    return Fnv1a(absl::StrCat(id, "/", host));
  }();
  return hash;
}

// Transports alive in this process, by instance id.
class LocalInstances {
 public:
  static LocalInstances& Get() {
    static LocalInstances* const instances = new LocalInstances;  // never freed
    return *instances;
  }
  uint64_t Add() {
    absl::MutexLock lock(&mu_);
    uint64_t id;
    do {
      id = (static_cast<uint64_t>(random_()) << 32) ^ random_() ^ ++counter_;
    } while (id == 0 || live_.contains(id));
    live_.insert(id);
    return id;
  }
  void Remove(uint64_t id) {
    absl::MutexLock lock(&mu_);
    live_.erase(id);
  }
  bool Live(uint64_t id) {
    absl::MutexLock lock(&mu_);
    return live_.contains(id);
  }

 private:
  absl::Mutex mu_;
  std::random_device random_;
  uint64_t counter_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<uint64_t> live_ ABSL_GUARDED_BY(mu_);
};

// True if `peer` is known to be gone: a Transport of this process that was
// destroyed, or a process on this host that exited. Peers on other hosts are
// never "known gone" here; UCX's peer error handling covers them.
bool PeerKnownGone(const PeerIdentity& peer) {
  if (peer.boot != BootHash()) return false;
  if (peer.pid == static_cast<uint32_t>(getpid())) {
    return !LocalInstances::Get().Live(peer.instance);
  }
  return ProcessStartTime(peer.pid) != peer.start_time;
}

// ---------------------------------------------------------------------------
// Shared memory that does not outlive this process.
//
// UCX 1.13's posix transport allocates a region (ucp_mem_map with
// UCP_MEM_MAP_ALLOCATE) as a named file, /dev/shm/ucx_shm_posix_<id>: it
// creates the file, writes the region's whole length of zeros into it (64 KiB
// at a time, to see that the memory exists), and only then unlinks it, peers
// opening it through /proc/<pid>/fd (UCX_POSIX_USE_PROC_LINK=y, the default);
// with UCX_POSIX_USE_PROC_LINK=n the name stays while the region is mapped.
// A process killed in between - SIGKILL, or the OOM killer, which that very
// write may wake - leaves the file and its memory behind: for seconds per GiB
// of a region with the default, for the region's whole life without it. So
// UCX creates these files (UCX_POSIX_DIR) in a directory private to this
// process, and a small process forked for it, a reaper, removes the directory
// with whatever is in it once this process has ended, however it ended. The
// reaper holds nothing of this process but a pipe, whose end it waits for,
// and the directory.

// Whether UCX_TLS `tls` may select the posix shared-memory transport.
bool MayUsePosixSharedMemory(absl::string_view tls) {
  if (tls.empty()) return true;  // UCX's choice
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    name = absl::StripAsciiWhitespace(name);
    if (!name.empty() && name[0] == '^') return true;  // exclusion list
    if (name == "posix" || name == "sm" || name == "shm" || name == "mm" || name == "all") {
      return true;
    }
  }
  return false;
}

void LogShm(const std::string& line) { std::fprintf(stderr, "zeroshard ucx: %s\n", line.c_str()); }

// Closes every descriptor but `keep_a` and `keep_b` (async-signal-safe).
void CloseAllExcept(int keep_a, int keep_b, int max_fd) {
  const int lo = std::min(keep_a, keep_b);
  const int hi = std::max(keep_a, keep_b);
  auto close_span = [max_fd](unsigned first, unsigned last) {
    if (first > last) return;
#ifdef SYS_close_range
    if (syscall(SYS_close_range, first, last, 0) == 0) return;
#endif
    for (unsigned fd = first; fd <= last && fd < static_cast<unsigned>(max_fd); ++fd) {
      close(static_cast<int>(fd));
    }
  };
  if (lo > 0) close_span(0, lo - 1);
  if (hi > lo + 1) close_span(lo + 1, hi - 1);
  close_span(hi + 1, ~0u);
}

// The reaper, in the forked child. The parent has threads, so only
// async-signal-safe calls from here on: no allocation, no locks, no stdio.
[[noreturn]] void RunShmReaper(int parent_gone, int dir, const char* path, int max_fd) {
  setsid();  // out of the parent's process group and its signals
  // Keeps no directory of the parent's busy (failing is harmless).
  [[maybe_unused]] const int at_root = chdir("/");
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGPIPE, SIGUSR1, SIGUSR2}) {
    sigaction(sig, &ignore, nullptr);
  }
  prctl(PR_SET_NAME, "zs-shm-reaper", 0, 0, 0);
  // Not the parent's sockets, nor the pipes its readers wait to see closed.
  CloseAllExcept(parent_gone, dir, max_fd);
  char byte;
  for (;;) {
    const ssize_t n = read(parent_gone, &byte, 1);
    if (n == 0 || (n < 0 && errno != EINTR)) break;
  }
  alignas(struct dirent64) char buf[4096];
  // Unlinking while listing may skip entries: list again until only "." and
  // ".." are left (bounded, should something keep adding files).
  for (int pass = 0; pass < 1000; ++pass) {
    if (lseek(dir, 0, SEEK_SET) != 0) break;
    bool removed = false;
    for (;;) {
      const long n = syscall(SYS_getdents64, dir, buf, sizeof(buf));
      if (n <= 0) break;
      for (long at = 0; at < n;) {
        const auto* d = reinterpret_cast<const struct dirent64*>(buf + at);
        at += d->d_reclen;
        const char* name = d->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'))) {
          continue;
        }
        removed |= unlinkat(dir, name, 0) == 0;
      }
    }
    if (!removed) break;
  }
  unlinkat(AT_FDCWD, path, AT_REMOVEDIR);
  _exit(0);
}

// Creates the private directory under `base` and forks its reaper; empty
// (and logged) when either fails.
std::string CreatePrivateShmDirectory(const std::string& base) {
  std::string path = absl::StrCat(base, "/zeroshard-ucx.", getpid(), ".XXXXXX");
  if (mkdtemp(path.data()) == nullptr) {
    LogShm(absl::StrCat("cannot create a private directory under ", base, " (",
                        std::strerror(errno),
                        "): shared-memory regions keep UCX's default place, "
                        "and one may outlive a killed process"));
    return "";
  }
  const int dir = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int parent_gone[2] = {-1, -1};
  struct rlimit files {};
  const int max_fd = getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY &&
                             files.rlim_cur < (1u << 20)
                         ? static_cast<int>(files.rlim_cur)
                         : 1 << 20;
  pid_t reaper = -1;
  if (dir >= 0 && pipe2(parent_gone, O_CLOEXEC) == 0) {
    reaper = fork();
    if (reaper == 0) RunShmReaper(parent_gone[0], dir, path.c_str(), max_fd);
  }
  const int error = errno;
  if (parent_gone[0] >= 0) close(parent_gone[0]);
  if (dir >= 0) close(dir);
  if (reaper < 0) {
    if (parent_gone[1] >= 0) close(parent_gone[1]);
    rmdir(path.c_str());
    LogShm(absl::StrCat("cannot start the reaper of ", path, " (", std::strerror(error),
                        "): shared-memory regions keep UCX's default place, "
                        "and one may outlive a killed process"));
    return "";
  }
  // parent_gone[1] stays open for the life of this process (close-on-exec):
  // its end is the reaper's signal.
  return path;
}

// This process's private directory for UCX's shared-memory files, created
// with its reaper on first use; empty when that failed. Under UCX_POSIX_DIR
// when the environment sets it, else /dev/shm.
const std::string& PrivateShmDirectory() {
  static const std::string* const path = [] {
    const char* configured = std::getenv("UCX_POSIX_DIR");
    return new std::string(CreatePrivateShmDirectory(
        configured != nullptr && configured[0] != '\0' ? configured : "/dev/shm"));
  }();
  return *path;
}

// ---------------------------------------------------------------------------
// Context, shared by the Transport, its workers and its Regions.

// The UCX_TLS value UCX reads: `tls` if given, else the environment's.
std::string EffectiveTls(const std::string& tls) {
  if (!tls.empty()) return tls;
  const char* env = std::getenv("UCX_TLS");
  return env != nullptr ? env : "";
}

// Which transport resources `context` selected, as ucx_tls.h reads them from
// ucp_context_print_info(); empty if that text cannot be had.
std::vector<std::string> ContextTransports(ucp_context_h context) {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return {};
  ucp_context_print_info(context, stream);
  std::fclose(stream);
  std::vector<std::string> selected =
      SelectedTransports(absl::string_view(text, size));
  std::free(text);
  return selected;
}

class Context {
 public:
  static absl::StatusOr<std::shared_ptr<Context>> Create(
      const UcxTransportOptions& options) {
    ucp_config_t* config = nullptr;
    ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
    if (status != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("ucp_config_read: ", UcsText(status)));
    }
    if (!options.tls.empty()) {
      status = ucp_config_modify(config, "TLS", options.tls.c_str());
      if (status != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(absl::StrCat(
            "UCX_TLS=\"", options.tls, "\": ", UcsText(status)));
      }
    }
    // Shared-memory files go to the directory that dies with this process
    // (see PrivateShmDirectory). "DIR" is the posix memory domain's own name
    // for UCX_POSIX_DIR: UCX applies it when it opens that domain.
    const std::string tls = EffectiveTls(options.tls);
    if (MayUsePosixSharedMemory(tls)) {
      if (const std::string& dir = PrivateShmDirectory(); !dir.empty()) {
        status = ucp_config_modify(config, "DIR", dir.c_str());
        if (status != UCS_OK) {
          ucp_config_release(config);
          return absl::InternalError(
              absl::StrCat("UCX_POSIX_DIR=\"", dir, "\": ", UcsText(status)));
        }
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES |
                        UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                        UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;  // mem_map/rkey_pack from caller threads
    params.name = "zeroshard";
    ucp_context_h handle = nullptr;
    status = ucp_init(&params, config, &handle);
    ucp_config_release(config);
    if (status != UCS_OK) {
      return absl::UnavailableError(absl::StrCat(
          "ucp_init (UCX_TLS=\"", options.tls, "\"): ", UcsText(status)));
    }
    return std::shared_ptr<Context>(new Context(
        handle, DecideKeyEnforcement(tls, ContextTransports(handle))));
  }

  ~Context() { ucp_cleanup(handle_); }
  ucp_context_h handle() const { return handle_; }
  // From the UCX_TLS in effect and the resources UCX selected for it.
  const KeyEnforcement& key_enforcement() const { return key_enforcement_; }

 private:
  Context(ucp_context_h handle, KeyEnforcement key_enforcement)
      : handle_(handle), key_enforcement_(std::move(key_enforcement)) {}
  ucp_context_h handle_;
  const KeyEnforcement key_enforcement_;
};

class UcxRegion : public Region {
 public:
  UcxRegion(std::shared_ptr<Context> context, ucp_mem_h memh, void* base,
            size_t length, RegionDescriptor descriptor)
      : context_(std::move(context)),
        memh_(memh),
        base_(base),
        length_(length),
        descriptor_(std::move(descriptor)) {}
  ~UcxRegion() override { ucp_mem_unmap(context_->handle(), memh_); }

  const RegionDescriptor& Descriptor() const override { return descriptor_; }
  void* base() const override { return base_; }
  size_t length() const override { return length_; }

 private:
  std::shared_ptr<Context> context_;
  ucp_mem_h memh_;
  void* base_;
  size_t length_;
  RegionDescriptor descriptor_;
};

// ---------------------------------------------------------------------------
// Endpoints and operations. Fields marked "worker" are touched only by the
// owning worker's thread.

class Worker;
struct Op;

struct Endpoint : std::enable_shared_from_this<Endpoint> {
  Endpoint(std::string peer_name, PeerIdentity peer, std::string worker_address)
      : peer_name(std::move(peer_name)),
        peer(peer),
        worker_address(std::move(worker_address)),
        closed(std::make_shared<CompletionState>()) {}
  ~Endpoint() {
    if (pidfd >= 0) close(pidfd);
  }

  const std::string peer_name;
  const PeerIdentity peer;
  const std::string worker_address;  // UCX's packed bytes
  // Finished when UCX has released the endpoint (or it never opened).
  const std::shared_ptr<CompletionState> closed;

  // worker:
  Worker* worker = nullptr;  // set by Open
  ucp_ep_h ep = nullptr;
  bool peer_errors = false;  // UCX reports peer failure (err mode PEER)
  int pidfd = -1;            // the peer process, when watched (see CheckPeer)
  absl::Time last_liveness_check = absl::InfinitePast();
  bool closing = false;  // ucp_ep_close_nbx was called
  absl::Status failed;   // non-OK once unusable; later ops fail with it
  // Unpacked rkeys by packed bytes; one per distinct region used.
  absl::flat_hash_map<std::string, ucp_rkey_h> rkeys;
  std::deque<Op*> queue;  // ops still posting, in issue order
  int outstanding = 0;    // UCX requests in flight on this endpoint
  bool fence_needed = false;
  bool pumping = false;
  bool repump = false;
};

struct Op : CompletionState, std::enable_shared_from_this<Op> {
  enum class Kind { kPut, kGet, kFlush };

  Op(Kind kind, std::shared_ptr<Worker> worker,
     std::shared_ptr<Endpoint> endpoint)
      : kind(kind), worker(std::move(worker)), endpoint(std::move(endpoint)) {}

  const Kind kind;
  const std::shared_ptr<Worker> worker;
  const std::shared_ptr<Endpoint> endpoint;
  char* local = nullptr;
  size_t length = 0;
  uint64_t remote_address = 0;
  std::string rkey;  // UCX's packed bytes (unwrapped)

  // worker:
  ucp_rkey_h rkey_handle = nullptr;
  PiecePlan plan;              // pieces of `length`; offset(): first not posted
  int pieces_outstanding = 0;  // data requests in flight
  bool flush_outstanding = false;
  bool flush_posted = false;
  bool started = false;
  bool queued = false;  // in endpoint->queue
  bool aborted = false;
  bool finished = false;
  bool released = false;  // handed back to the caller before UCX let go
  absl::Status error;

 protected:
  void OnAbort() override;
};

absl::Status ShutDownError(absl::string_view name) {
  return absl::FailedPreconditionError(
      absl::StrCat("UCX transport \"", name, "\" is shut down"));
}

// ---------------------------------------------------------------------------
// Worker: one ucp_worker and the thread that owns it.

class Worker : public std::enable_shared_from_this<Worker> {
 public:
  static absl::StatusOr<std::shared_ptr<Worker>> Start(
      std::shared_ptr<Context> context, std::string name,
      const UcxTransportOptions& options) {
    std::shared_ptr<Worker> worker(
        new Worker(std::move(context), std::move(name), options));
    worker->thread_ = std::thread([w = worker.get()] { w->Run(); });
    worker->started_.WaitForNotification();
    if (!worker->init_status_.ok()) {
      worker->thread_.join();
      return worker->init_status_;
    }
    return worker;
  }

  ~Worker() {
    Stop();
    if (wake_fd_ >= 0) close(wake_fd_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
  }

  const std::string& name() const { return name_; }
  size_t piece_bytes() const { return piece_bytes_; }
  // Packed ucp worker address (valid after Start).
  const std::string& address() const { return address_; }

  // Queues `task` for the worker thread; false once stopping (task dropped).
  bool Post(absl::AnyInvocable<void()> task) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return false;
      tasks_.push_back(std::move(task));
    }
    Wake();
    return true;
  }

  // Closes every endpoint (bounded), fails what is left, destroys the
  // ucp_worker and joins the thread. Idempotent; not from the worker thread.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_ || !thread_.joinable()) return;
      stopping_ = true;
    }
    Wake();
    thread_.join();
  }

  // ---- worker thread only ----

  void Open(const std::shared_ptr<Endpoint>& e);
  void Close(const std::shared_ptr<Endpoint>& e, bool force,
             absl::Status reason);
  void StartOp(std::shared_ptr<Op> op);
  void AbortOp(const std::shared_ptr<Op>& op);

 private:
  Worker(std::shared_ptr<Context> context, std::string name,
         const UcxTransportOptions& options)
      : context_(std::move(context)),
        name_(std::move(name)),
        piece_bytes_(options.common.max_piece_bytes),
        window_(options.max_pieces_in_flight),
        peer_error_mode_(WantsPeerErrorMode(options.tls)),
        wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

  void Wake() {
    const uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
  }

  void Run();
  absl::Status Init();
  void Loop();
  void Shutdown();
  bool RunTasks();  // true once stopping
  void Sleep(int timeout_ms);

  void Pump(std::shared_ptr<Endpoint> e);
  // Posts what the op may post now; true once it has nothing left to post.
  bool PostMore(Endpoint& e, Op& op);
  void PostFlush(Endpoint& e, Op& op);
  void RequestDone(Op& op, bool flush, ucs_status_t status);
  void CloseFailed();
  // For endpoints without UCX peer error handling: fails the endpoint if its
  // peer process (or, in this process, its Transport) is gone. `force`
  // skips the rate limit for other processes.
  void CheckPeer(const std::shared_ptr<Endpoint>& e, bool force);
  void CheckPeers();
  // Opens a pidfd on a peer process of this host, so CheckPeer can test it
  // cheaply on every operation and a sleeping worker wakes when it exits.
  void WatchPeerProcess(Endpoint& e);
  void StopWatching(Endpoint& e);
  void MaybeFinish(Op& op);
  // Finishes the caller's handle early; UCX may still hold the request,
  // which stays tracked (but no longer keeps the thread polling).
  void Release(Op& op, absl::Status status);
  void Dequeue(Endpoint& e, Op& op);
  // The op's error for a failed UCX call; also marks the endpoint failed
  // unless the request was merely cancelled.
  absl::Status ErrorFor(Endpoint& e, ucs_status_t status,
                        absl::string_view what);
  absl::StatusOr<ucp_rkey_h> Rkey(Endpoint& e, const std::string& packed);
  void DestroyRkeys(Endpoint& e);
  void Closed(Endpoint& e);

  static void OnRequestDone(void* request, ucs_status_t status,
                            void* user_data);
  static void OnFlushDone(void* request, ucs_status_t status, void* user_data);
  static void OnCloseDone(void* request, ucs_status_t status, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

  const std::shared_ptr<Context> context_;
  const std::string name_;
  const size_t piece_bytes_;
  const int window_;
  const bool peer_error_mode_;
  const int wake_fd_;  // eventfd that Post() writes to wake the thread
  std::thread thread_;
  absl::Notification started_;
  absl::Status init_status_;
  std::string address_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);

  // worker:
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;  // UCX's, or -1 if it offers none
  int epoll_fd_ = -1;
  bool shutting_down_ = false;
  absl::flat_hash_map<Op*, std::shared_ptr<Op>> ops_;  // unfinished ops
  size_t released_ = 0;  // ops in ops_ already handed back (see Release)
  absl::flat_hash_set<std::shared_ptr<Endpoint>> endpoints_;  // open/closing
  std::vector<std::shared_ptr<Endpoint>> failed_;  // to close after progress
  absl::Time last_peer_check_ = absl::InfinitePast();
  bool peer_exited_ = false;  // a watched peer's pidfd fired
};

// ---------------------------------------------------------------------------
// Worker thread.

void Worker::Run() {
  init_status_ = Init();
  const bool ok = init_status_.ok();
  started_.Notify();  // `this` may be joined and destroyed after this if !ok
  if (!ok) return;
  Loop();
  Shutdown();
}

absl::Status Worker::Init() {
  if (wake_fd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  ucp_worker_params_t params{};
  params.field_mask =
      UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only this thread touches it
  params.name = name_.c_str();
  ucs_status_t status =
      ucp_worker_create(context_->handle(), &params, &worker_);
  if (status != UCS_OK) {
    worker_ = nullptr;
    return absl::UnavailableError(
        absl::StrCat("ucp_worker_create: ", UcsText(status)));
  }
  ucp_address_t* address = nullptr;
  size_t length = 0;
  status = ucp_worker_get_address(worker_, &address, &length);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    return absl::UnavailableError(
        absl::StrCat("ucp_worker_get_address: ", UcsText(status)));
  }
  address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);

  if (ucp_worker_get_efd(worker_, &event_fd_) != UCS_OK) event_fd_ = -1;
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("epoll_create1: ", std::strerror(errno)));
  }
  for (int fd : {wake_fd_, event_fd_}) {
    if (fd < 0) continue;
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
  }
  return absl::OkStatus();
}

bool Worker::RunTasks() {
  std::vector<absl::AnyInvocable<void()>> tasks;
  bool stopping;
  {
    absl::MutexLock lock(&mu_);
    tasks.swap(tasks_);
    stopping = stopping_;
  }
  for (auto& task : tasks) task();
  return stopping;
}

void Worker::Loop() {
  int idle_rounds = kSpinRounds;
  while (!RunTasks()) {
    unsigned events = 0;
    for (int i = 0; i < 64; ++i) {
      const unsigned n = ucp_worker_progress(worker_);
      if (n == 0) break;
      events += n;
    }
    CloseFailed();
    CheckPeers();
    if (events != 0) {
      idle_rounds = 0;
      continue;
    }
    // Keep polling for a while after the last event (a stream of incoming
    // traffic, or our own requests); then sleep on the worker's events, which
    // also wake us for remote traffic we serve.
    if (idle_rounds < kSpinRounds) {
      ++idle_rounds;
      // Lets the peer's thread run when cores are oversubscribed (a serving
      // thread on the same core is often what we are waiting for).
      std::this_thread::yield();
      continue;
    }
    const bool busy = ops_.size() > released_ ||
                      std::any_of(endpoints_.begin(), endpoints_.end(),
                                  [](const auto& e) { return e->closing; });
    Sleep(busy ? 1 : 100);
  }
}

void Worker::Sleep(int timeout_ms) {
  if (event_fd_ >= 0) {
    const ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_ERR_BUSY) return;  // events pending: progress again
  } else {
    timeout_ms = 1;  // no wakeup support: poll
  }
  {
    absl::MutexLock lock(&mu_);
    if (!tasks_.empty() || stopping_) return;
  }
  epoll_event events[8];
  const int n = epoll_wait(epoll_fd_, events, 8, timeout_ms);
  for (int i = 0; i < n; ++i) {
    const int fd = events[i].data.fd;
    if (fd != wake_fd_ && fd != event_fd_) peer_exited_ = true;  // a pidfd
  }
  uint64_t value;
  while (read(wake_fd_, &value, sizeof(value)) > 0) {
  }
}

void Worker::CloseFailed() {
  while (!failed_.empty()) {
    std::vector<std::shared_ptr<Endpoint>> failed;
    failed.swap(failed_);
    for (auto& e : failed) Close(e, /*force=*/true, e->failed);
  }
}

void Worker::Shutdown() {
  shutting_down_ = true;
  RunTasks();  // whatever was queued before Stop(); new ops fail
  std::vector<std::shared_ptr<Endpoint>> open(endpoints_.begin(),
                                              endpoints_.end());
  for (auto& e : open) Close(e, /*force=*/true, ShutDownError(name_));
  const absl::Time until = absl::Now() + kCloseWait;
  while (!endpoints_.empty() && absl::Now() < until) {
    ucp_worker_progress(worker_);
    CloseFailed();
  }
  for (auto& e : endpoints_) DestroyRkeys(*e);
  ucp_worker_destroy(worker_);  // no UCX callbacks after this
  worker_ = nullptr;
  for (auto& [raw, op] : ops_) op->Finish(ShutDownError(name_));
  ops_.clear();
  released_ = 0;
  for (auto& e : endpoints_) {
    StopWatching(*e);
    e->closed->Finish(absl::OkStatus());
  }
  endpoints_.clear();
  close(epoll_fd_);
  epoll_fd_ = -1;
}

// ---------------------------------------------------------------------------
// Endpoints.

void Worker::Open(const std::shared_ptr<Endpoint>& e) {
  e->worker = this;
  if (shutting_down_) {
    e->failed = ShutDownError(name_);
    e->closed->Finish(absl::OkStatus());
    return;
  }
  // UCX would attach to whatever now sits at a dead local peer's shared
  // memory handles; refuse before it tries.
  if (PeerKnownGone(e->peer)) {
    e->failed = absl::UnavailableError(absl::StrCat("UCX peer \"", e->peer_name,
                                                    "\" (process ", e->peer.pid,
                                                    ") has gone away"));
    e->closed->Finish(absl::OkStatus());
    return;
  }
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address =
      reinterpret_cast<const ucp_address_t*>(e->worker_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Worker::OnEndpointError;
  params.err_handler.arg = e.get();
  ucs_status_t status = UCS_ERR_UNREACHABLE;
  // A peer on this host is reached over shared memory where UCX may choose
  // it, which cannot carry peer error handling (UCX logs an error for each
  // attempt); its death is noticed by watching its process instead.
  const bool same_host = e->peer.boot == BootHash();
  if (peer_error_mode_ && !same_host) {
    status = ucp_ep_create(worker_, &params, &e->ep);
    e->peer_errors = status == UCS_OK;
  }
  if (status == UCS_ERR_UNREACHABLE) {  // no lane can report peer failure
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    status = ucp_ep_create(worker_, &params, &e->ep);
  }
  if (status != UCS_OK) {
    e->ep = nullptr;
    e->failed = absl::UnavailableError(absl::StrCat(
        "UCX peer \"", e->peer_name, "\": ucp_ep_create: ", UcsText(status)));
    e->closed->Finish(absl::OkStatus());
    return;
  }
  if (!e->peer_errors) WatchPeerProcess(*e);
  endpoints_.insert(e);
}

void Worker::WatchPeerProcess(Endpoint& e) {
  if (e.peer.boot != BootHash() ||
      e.peer.pid == static_cast<uint32_t>(getpid())) {
    return;  // another host (nothing to watch), or this process (registry)
  }
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, e.peer.pid, 0));
  if (fd < 0) return;  // old kernel or no permission: /proc checks instead
  // Still the same process (not a reused pid) now that we hold it?
  if (ProcessStartTime(e.peer.pid) != e.peer.start_time) {
    close(fd);
    return;
  }
  e.pidfd = fd;
  // Also wake a sleeping worker the moment the peer exits.
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = fd;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
}

void Worker::OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  Endpoint* e = static_cast<Endpoint*>(arg);
  if (e->failed.ok()) {
    e->failed = absl::UnavailableError(absl::StrCat(
        "UCX peer \"", e->peer_name, "\" failed: ", UcsText(status)));
  }
  // Closing from inside UCX's callback is not allowed; do it after progress.
  e->worker->failed_.push_back(e->shared_from_this());
}

void Worker::Close(const std::shared_ptr<Endpoint>& e, bool force,
                   absl::Status reason) {
  if (e->failed.ok()) e->failed = std::move(reason);
  Pump(e);  // fails ops that have not posted anything yet
  if (e->closing) return;
  if (e->ep == nullptr) {
    e->closed->Finish(absl::OkStatus());
    return;
  }
  // rkeys go before the endpoint, unless requests still use them (then they
  // go once the forced close has cancelled those requests).
  if (e->outstanding == 0) DestroyRkeys(*e);
  ucp_ep_h ep = e->ep;
  e->ep = nullptr;
  e->closing = true;
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // UCX refuses to force-close an endpoint without peer error handling (a
  // peer on this host): it answers INVALID_PARAM and leaves the endpoint
  // open, with its requests, until the worker is destroyed, which releases
  // them. A flush close would be no better: to a dead peer it never ends,
  // and destroying the worker then fails UCX's check that the close request
  // was released.
  params.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  params.cb.send = &Worker::OnCloseDone;
  params.user_data = e.get();
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &params);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) Closed(*e);
}

void Worker::OnCloseDone(void* request, ucs_status_t, void* user_data) {
  ucp_request_free(request);
  Endpoint* e = static_cast<Endpoint*>(user_data);
  e->worker->Closed(*e);
}

void Worker::Closed(Endpoint& e) {
  auto keep = e.shared_from_this();
  StopWatching(e);
  DestroyRkeys(e);
  e.closing = false;
  endpoints_.erase(keep);
  e.closed->Finish(absl::OkStatus());
}

void Worker::DestroyRkeys(Endpoint& e) {
  for (auto& [packed, rkey] : e.rkeys) ucp_rkey_destroy(rkey);
  e.rkeys.clear();
}

absl::StatusOr<ucp_rkey_h> Worker::Rkey(Endpoint& e,
                                        const std::string& packed) {
  auto it = e.rkeys.find(packed);
  if (it != e.rkeys.end()) return it->second;
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t status = ucp_ep_rkey_unpack(e.ep, packed.data(), &rkey);
  if (status != UCS_OK) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor's rkey does not unpack for UCX peer \"",
                     e.peer_name, "\": ", UcsText(status)));
  }
  e.rkeys.emplace(packed, rkey);
  return rkey;
}

void Worker::CheckPeers() {
  const absl::Time now = absl::Now();
  if (!peer_exited_ && now - last_peer_check_ < kLivenessInterval) return;
  peer_exited_ = false;
  last_peer_check_ = now;
  std::vector<std::shared_ptr<Endpoint>> watched;
  for (const auto& e : endpoints_) {
    if (!e->peer_errors && e->ep != nullptr &&
        (e->pidfd >= 0 || e->outstanding > 0 || !e->queue.empty())) {
      watched.push_back(e);
    }
  }
  for (const auto& e : watched) CheckPeer(e, /*force=*/false);
}

void Worker::StopWatching(Endpoint& e) {
  if (e.pidfd < 0) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, e.pidfd, nullptr);
  close(e.pidfd);
  e.pidfd = -1;
}

void Worker::CheckPeer(const std::shared_ptr<Endpoint>& e, bool force) {
  if (e->peer_errors || e->ep == nullptr || e->peer.boot != BootHash()) return;
  bool gone;
  if (e->pidfd >= 0) {  // readable once the process has exited
    pollfd p{e->pidfd, POLLIN, 0};
    gone = poll(&p, 1, 0) > 0;
  } else if (e->peer.pid == static_cast<uint32_t>(getpid())) {
    gone = !LocalInstances::Get().Live(e->peer.instance);
  } else {
    const absl::Time now = absl::Now();
    if (!force && now - e->last_liveness_check < kLivenessInterval) return;
    e->last_liveness_check = now;
    gone = PeerKnownGone(e->peer);
  }
  if (!gone) return;
  StopWatching(*e);
  e->failed = absl::UnavailableError(absl::StrCat("UCX peer \"", e->peer_name,
                                                  "\" (process ", e->peer.pid,
                                                  ") has gone away"));
  Close(e, /*force=*/true, e->failed);
  // UCX will not complete requests waiting on a dead peer, and nothing will
  // write into their buffers any more: hand them back now. The ops stay
  // tracked until UCX lets go of them (or the worker is destroyed).
  for (auto& [raw, op] : ops_) {
    if (op->endpoint == e) Release(*op, e->failed);
  }
}

// ---------------------------------------------------------------------------
// Operations.

void Op::OnAbort() {
  std::shared_ptr<Op> self = shared_from_this();
  // If the worker is stopping, shutdown finishes the op anyway.
  (void)worker->Post([self] { self->worker->AbortOp(self); });
}

void Worker::StartOp(std::shared_ptr<Op> op) {
  Endpoint& e = *op->endpoint;
  if (shutting_down_) {
    op->Finish(ShutDownError(name_));
    return;
  }
  if (op->abort_requested()) {
    op->Finish(absl::CancelledError("UCX operation aborted before it started"));
    return;
  }
  if (!e.peer_errors) CheckPeer(op->endpoint, /*force=*/false);
  if (e.ep == nullptr) {
    op->Finish(e.failed.ok() ? absl::InternalError("UCX endpoint not open")
                             : e.failed);
    return;
  }
  if (op->kind != Op::Kind::kFlush) {
    absl::StatusOr<ucp_rkey_h> rkey = Rkey(e, op->rkey);
    if (!rkey.ok()) {
      op->Finish(rkey.status());
      return;
    }
    op->rkey_handle = *rkey;
  }
  ops_[op.get()] = op;
  op->queued = true;
  e.queue.push_back(op.get());
  Pump(op->endpoint);
}

void Worker::Pump(std::shared_ptr<Endpoint> ep) {
  Endpoint& e = *ep;
  if (e.pumping) {  // re-entered from a UCX callback; the outer loop reruns
    e.repump = true;
    return;
  }
  e.pumping = true;
  do {
    e.repump = false;
    while (!e.queue.empty()) {
      Op& op = *e.queue.front();
      if (op.error.ok() && !e.failed.ok()) op.error = e.failed;
      if (!op.error.ok() || op.aborted) {
        Dequeue(e, op);
        MaybeFinish(op);
        continue;
      }
      if (!op.started) {
        op.started = true;
        // Orders this op after every earlier one on the worker (so on this
        // endpoint): a later Put wins, a Get sees earlier Puts.
        if (e.fence_needed) {
          const ucs_status_t status = ucp_worker_fence(worker_);
          if (status != UCS_OK) {
            op.error = ErrorFor(e, status, "fence before");
            continue;
          }
        }
      }
      if (!PostMore(e, op)) break;  // window full; a completion resumes it
      e.fence_needed = true;
      Dequeue(e, op);
      MaybeFinish(op);
    }
  } while (e.repump);
  e.pumping = false;
}

bool Worker::PostMore(Endpoint& e, Op& op) {
  if (op.kind == Op::Kind::kFlush) {
    if (!op.flush_posted) PostFlush(e, op);
    return true;
  }
  while (!op.plan.done()) {
    if (op.pieces_outstanding >= window_) return false;
    const PiecePlan::Piece piece = op.plan.Next();
    ucp_request_param_t params{};
    params.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    params.cb.send = &Worker::OnRequestDone;
    params.user_data = &op;
    ucs_status_ptr_t request =
        op.kind == Op::Kind::kPut
            ? ucp_put_nbx(e.ep, op.local + piece.offset, piece.length,
                          op.remote_address + piece.offset, op.rkey_handle,
                          &params)
            : ucp_get_nbx(e.ep, op.local + piece.offset, piece.length,
                          op.remote_address + piece.offset, op.rkey_handle,
                          &params);
    if (UCS_PTR_IS_ERR(request)) {
      op.error = ErrorFor(e, UCS_PTR_STATUS(request),
                          op.kind == Op::Kind::kPut ? "put to" : "get from");
      return true;
    }
    if (request != nullptr) {
      ++op.pieces_outstanding;
      ++e.outstanding;
    }
  }
  if (op.kind == Op::Kind::kPut && !op.flush_posted) PostFlush(e, op);
  return true;
}

void Worker::PostFlush(Endpoint& e, Op& op) {
  op.flush_posted = true;
  ucp_request_param_t params{};
  params.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.send = &Worker::OnFlushDone;
  params.user_data = &op;
  ucs_status_ptr_t request = ucp_ep_flush_nbx(e.ep, &params);
  if (UCS_PTR_IS_ERR(request)) {
    op.error = ErrorFor(e, UCS_PTR_STATUS(request), "flush of");
  } else if (request != nullptr) {
    op.flush_outstanding = true;
    ++e.outstanding;
  }
}

void Worker::OnRequestDone(void* request, ucs_status_t status,
                           void* user_data) {
  ucp_request_free(request);
  Op* op = static_cast<Op*>(user_data);
  op->worker->RequestDone(*op, /*flush=*/false, status);
}

void Worker::OnFlushDone(void* request, ucs_status_t status, void* user_data) {
  ucp_request_free(request);
  Op* op = static_cast<Op*>(user_data);
  op->worker->RequestDone(*op, /*flush=*/true, status);
}

void Worker::RequestDone(Op& op, bool flush, ucs_status_t status) {
  std::shared_ptr<Endpoint> e = op.endpoint;  // op may be gone below
  if (flush) {
    op.flush_outstanding = false;
  } else {
    --op.pieces_outstanding;
  }
  --e->outstanding;
  if (status != UCS_OK && op.error.ok()) {
    op.error = ErrorFor(*e, status,
                        flush                       ? "flush of"
                        : op.kind == Op::Kind::kPut ? "put to"
                                                    : "get from");
  }
  if (op.queued) {
    Pump(e);
  } else {
    MaybeFinish(op);
  }
  if (e->outstanding == 0 && e->closing) DestroyRkeys(*e);
}

void Worker::Dequeue(Endpoint& e, Op& op) {
  auto it = std::find(e.queue.begin(), e.queue.end(), &op);
  if (it != e.queue.end()) e.queue.erase(it);
  op.queued = false;
}

void Worker::MaybeFinish(Op& op) {
  if (op.finished || op.queued || op.pieces_outstanding > 0 ||
      op.flush_outstanding) {
    return;
  }
  op.finished = true;
  absl::Status status = op.error;
  const bool all_posted =
      op.kind == Op::Kind::kFlush
          ? op.flush_posted
          : op.plan.done() &&
                (op.kind != Op::Kind::kPut || op.flush_posted);
  if (status.ok() && op.aborted && !all_posted) {
    status = absl::CancelledError("UCX operation aborted");
  }
  op.Finish(std::move(status));
  if (op.released) --released_;
  ops_.erase(&op);  // may destroy op
}

void Worker::Release(Op& op, absl::Status status) {
  if (op.finished || op.released) return;
  op.released = true;
  ++released_;
  op.Finish(std::move(status));
}

absl::Status Worker::ErrorFor(Endpoint& e, ucs_status_t status,
                              absl::string_view what) {
  if (!e.failed.ok()) return e.failed;
  if (status == UCS_ERR_CANCELED) {
    return absl::CancelledError(
        absl::StrCat("UCX ", what, " peer \"", e.peer_name, "\" cancelled"));
  }
  // Without UCX's peer error handling this is how a dead peer shows; with it
  // the error callback follows and finds the endpoint already failed.
  e.failed = absl::UnavailableError(absl::StrCat(
      "UCX ", what, " peer \"", e.peer_name, "\" failed: ", UcsText(status)));
  failed_.push_back(e.shared_from_this());
  return e.failed;
}

void Worker::AbortOp(const std::shared_ptr<Op>& op) {
  if (op->finished || !ops_.contains(op.get())) return;
  op->aborted = true;
  std::shared_ptr<Endpoint> e = op->endpoint;
  if (op->pieces_outstanding == 0) {
    // UCX holds none of the caller's buffer: drop the rest, keep the link.
    if (op->queued) Dequeue(*e, *op);
    if (op->flush_outstanding) {
      Release(*op, absl::CancelledError("UCX operation aborted"));
    }
    MaybeFinish(*op);
    Pump(e);
    return;
  }
  if (!e->peer_errors) {
    // Without peer error handling a forced close does not complete requests
    // either: post nothing more and let the pieces in flight finish (a dead
    // peer is noticed by CheckPeer, which hands the op back).
    Pump(e);
    return;
  }
  // Pieces are on the wire and UCX cannot cancel RMA: close the endpoint,
  // which completes them with UCS_ERR_CANCELED.
  op->error = absl::CancelledError(
      absl::StrCat("UCX operation aborted; its connection to \"", e->peer_name,
                   "\" was closed to stop it"));
  Close(e, /*force=*/true,
        absl::CancelledError(absl::StrCat(
            "connection to UCX peer \"", e->peer_name,
            "\" was closed because an operation on it was aborted")));
}

// ---------------------------------------------------------------------------
// Public objects.

class UcxConnection : public CheckedConnection {
 public:
  UcxConnection(std::shared_ptr<Worker> worker,
                std::shared_ptr<Endpoint> endpoint)
      : CheckedConnection("UCX"),
        worker_(std::move(worker)),
        endpoint_(std::move(endpoint)) {}

  ~UcxConnection() override {
    std::shared_ptr<Worker> worker = worker_;
    std::shared_ptr<Endpoint> e = endpoint_;
    const bool posted = worker->Post([worker, e] {
      worker->Close(
          e, /*force=*/e->outstanding > 0 || !e->failed.ok(),
          absl::CancelledError(absl::StrCat("connection to UCX peer \"",
                                            e->peer_name, "\" was closed")));
    });
    if (posted && wait_on_close_)
      (void)e->closed->Wait(absl::Now() + kCloseWait);
  }

  // The destructor then returns without waiting for the close to finish.
  void DontWaitOnClose() { wait_on_close_ = false; }

  const std::string& peer_name() const override { return endpoint_->peer_name; }

 private:
  // The packed rkey inside the envelope.
  absl::StatusOr<absl::string_view> CheckKey(
      const RegionDescriptor& remote, absl::string_view what) const override {
    return DecodeRkey(remote.rkey, absl::StrCat(what, ": descriptor's rkey"));
  }

  Completion Issue(const Request& request) override {
    auto op = std::make_shared<Op>(request.kind == Kind::kPut ? Op::Kind::kPut
                                                              : Op::Kind::kGet,
                                   worker_, endpoint_);
    op->local = request.local;
    op->length = request.length;
    op->plan = PiecePlan(request.length, worker_->piece_bytes());
    op->remote_address = request.remote_address;
    op->rkey.assign(request.key.data(), request.key.size());
    if (!worker_->Post([op] { op->worker->StartOp(op); })) {
      return Completion::Ready(ShutDownError(worker_->name()));
    }
    return Completion(std::move(op));
  }

  absl::StatusOr<std::shared_ptr<CompletionState>> IssueFlush() override {
    auto op = std::make_shared<Op>(Op::Kind::kFlush, worker_, endpoint_);
    if (!worker_->Post([op] { op->worker->StartOp(op); })) {
      return ShutDownError(worker_->name());
    }
    return op;
  }

  const std::shared_ptr<Worker> worker_;
  const std::shared_ptr<Endpoint> endpoint_;
  bool wait_on_close_ = true;
};

std::string DefaultName() {
  static std::atomic<int> instances{0};
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  return absl::StrCat("ucx:", host, ":", getpid(), ":", instances++);
}

class UcxTransport : public Transport {
 public:
  UcxTransport(std::string name, std::shared_ptr<Context> context,
               std::vector<std::shared_ptr<Worker>> workers)
      : name_(std::move(name)),
        context_(std::move(context)),
        workers_(std::move(workers)),
        instance_(LocalInstances::Get().Add()),
        address_(EncodeAddress(Identity(instance_), workers_[0]->address(), name_)) {}

  ~UcxTransport() override {
    LocalInstances::Get().Remove(instance_);  // peers here see it gone now
    for (auto& worker : workers_) worker->Stop();
  }

  absl::string_view kind() const override { return "ucx"; }

  bool enforces_remote_keys() const override {
    return context_->key_enforcement().enforced;
  }

  absl::StatusOr<std::unique_ptr<Region>> RegisterRegion(
      void* base, size_t length, Access access) override {
    if (base == nullptr || length == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("UCX RegisterRegion: empty region (base ",
                       absl::Hex(reinterpret_cast<uintptr_t>(base)),
                       ", length ", length, ")"));
    }
    return Map(base, length, access);
  }

  absl::StatusOr<std::unique_ptr<Region>> AllocateRegion(
      size_t length, Access access) override {
    if (length == 0) {
      return absl::InvalidArgumentError("UCX AllocateRegion: length 0");
    }
    return Map(nullptr, length, access);
  }

  const std::string& LocalAddress() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Connection>> Connect(
      absl::string_view peer_address, absl::Time deadline) override {
    absl::StatusOr<PeerAddress> peer = DecodeAddress(peer_address, "UCX Connect: peer address");
    if (!peer.ok()) return peer.status();
    auto e = std::make_shared<Endpoint>(
        peer->name.empty() ? std::string("unnamed") : std::move(peer->name), peer->identity,
        std::move(peer->worker_address));
    std::shared_ptr<Worker> worker =
        workers_[next_worker_.fetch_add(1) % workers_.size()];
    if (!worker->Post([worker, e] { worker->Open(e); })) {
      return ShutDownError(name_);
    }
    auto connection = std::make_unique<UcxConnection>(worker, e);
    // A flush completes once the link is wired up (or has failed).
    absl::Status status = connection->Flush(deadline);
    if (!status.ok()) {
      connection->DontWaitOnClose();  // keep to the caller's deadline
      return absl::Status(status.code(),
                          absl::StrCat("UCX connect to \"", e->peer_name,
                                       "\": ", status.message()));
    }
    return connection;
  }

 private:
  static PeerIdentity Identity(uint64_t instance) {
    PeerIdentity identity;
    identity.boot = BootHash();
    identity.pid = static_cast<uint32_t>(getpid());
    identity.start_time = ProcessStartTime(identity.pid);
    identity.instance = instance;
    return identity;
  }

  // Registers [base, base + length), or allocates it when base is null.
  absl::StatusOr<std::unique_ptr<Region>> Map(void* base, size_t length,
                                              Access access) {
    ucp_mem_map_params_t params{};
    params.field_mask =
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
        UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_PROT;
    params.address = base;
    params.length = length;
    params.flags = base == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
    params.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE;
    if (static_cast<uint8_t>(access) &
        static_cast<uint8_t>(Access::kRemoteRead)) {
      params.prot |= UCP_MEM_MAP_PROT_REMOTE_READ;
    }
    if (static_cast<uint8_t>(access) &
        static_cast<uint8_t>(Access::kRemoteWrite)) {
      params.prot |= UCP_MEM_MAP_PROT_REMOTE_WRITE;
    }
    ucp_mem_h memh = nullptr;
    ucs_status_t status = ucp_mem_map(context_->handle(), &params, &memh);
    if (status != UCS_OK) {
      return absl::ResourceExhaustedError(
          absl::StrCat(base == nullptr ? "UCX allocation" : "UCX registration",
                       " of ", length, " bytes: ", UcsText(status)));
    }
    if (base == nullptr) {
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      status = ucp_mem_query(memh, &attr);
      if (status != UCS_OK || attr.address == nullptr || attr.length < length) {
        ucp_mem_unmap(context_->handle(), memh);
        return absl::InternalError(
            absl::StrCat("ucp_mem_query: ", UcsText(status)));
      }
      base = attr.address;
      std::memset(base, 0, length);  // also faults the pages in now
    }
    void* packed = nullptr;
    size_t packed_size = 0;
    status = ucp_rkey_pack(context_->handle(), memh, &packed, &packed_size);
    if (status != UCS_OK) {
      ucp_mem_unmap(context_->handle(), memh);
      return absl::InternalError(
          absl::StrCat("ucp_rkey_pack: ", UcsText(status)));
    }
    RegionDescriptor descriptor;
    descriptor.address = reinterpret_cast<uintptr_t>(base);
    descriptor.length = length;
    descriptor.rkey = EncodeRkey(absl::string_view(static_cast<const char*>(packed), packed_size));
    ucp_rkey_buffer_release(packed);
    return std::make_unique<UcxRegion>(context_, memh, base, length,
                                       std::move(descriptor));
  }

  const std::string name_;
  const std::shared_ptr<Context> context_;
  const std::vector<std::shared_ptr<Worker>> workers_;
  const uint64_t instance_;
  const std::string address_;
  std::atomic<size_t> next_worker_{0};
};

const bool kRegistered = [] {
  (void)RegisterTransportFactory("ucx", [](const BackendOptions& options) {
    return CreateUcxTransport(options.ucx);
  });
  return true;
}();

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(
    const UcxTransportOptions& options) {
  if (options.progress_threads < 1 || options.common.max_piece_bytes == 0 ||
      options.max_pieces_in_flight < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX transport: progress_threads (", options.progress_threads,
        "), common.max_piece_bytes (", options.common.max_piece_bytes,
        ") and max_pieces_in_flight (", options.max_pieces_in_flight,
        ") must be positive"));
  }
  // What UCX_TLS asks for is refused before UCX even initialises; what UCX
  // selected for it, before any worker exists: nothing listens yet.
  if (options.common.require_enforced_remote_keys) {
    KeyEnforcement requested = CheckRequestedTls(EffectiveTls(options.tls));
    if (!requested.enforced) {
      return absl::FailedPreconditionError(std::move(requested.reason));
    }
  }
  absl::StatusOr<std::shared_ptr<Context>> context = Context::Create(options);
  if (!context.ok()) return context.status();
  if (options.common.require_enforced_remote_keys &&
      !(*context)->key_enforcement().enforced) {
    return absl::FailedPreconditionError(
        (*context)->key_enforcement().reason);
  }
  const std::string name =
      options.common.name.empty() ? DefaultName() : options.common.name;
  std::vector<std::shared_ptr<Worker>> workers;
  for (int i = 0; i < options.progress_threads; ++i) {
    absl::StatusOr<std::shared_ptr<Worker>> worker =
        Worker::Start(*context, absl::StrCat(name, "/", i), options);
    if (!worker.ok()) return worker.status();
    workers.push_back(*std::move(worker));
  }
  return std::make_unique<UcxTransport>(name, *std::move(context),
                                        std::move(workers));
}

}  // namespace zeroshard::transport::ucx
