#include "tools/zsrun_lib.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/auth.h"
#include "common/channel.h"
#include "common/format.h"
#include "common/glibc_tunables.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"

extern char** environ;

namespace zeroshard::tools {

// One child zsrun started; pid is also its process-group id.
struct Launcher::Proc {
  std::string label;  // "rank 0", "daemon 1"
  int rank = -1;      // trainers only
  pid_t pid = -1;
  bool running = false;
  bool seen = false;  // Its exit has been acted on.
  int exit_code = 0;
  uint64_t peak_rss_bytes = 0;  // once reaped: ru_maxrss
  // Daemons only.
  std::string address;
  int metrics_port = 0;
  // What it printed after "zeroshardd bulk transport ": "ucx", "grpc",
  // "none" (empty: nothing, as a daemon of an older version), and a ucx
  // one's UCX_TLS. Printed before its address.
  std::string bulk_transport;
  std::string ucx_tls;
  std::string stderr_path;
};

// A pipe from a child, read without blocking by Pump.
struct Launcher::Stream {
  const Proc* owner = nullptr;
  int fd = -1;         // -1 once at end of file.
  std::string prefix;  // Put before each line written to out_fd.
  int out_fd = -1;     // -1: not echoed.
  int log_fd = -1;     // Owned; gets the raw bytes. -1: none.
  std::function<void(absl::string_view)> on_line;
  LineSplitter splitter;
};

namespace {

constexpr absl::Duration kTick = absl::Milliseconds(50);
// How long SIGKILLed children get to be reaped before zsrun gives up on them.
constexpr absl::Duration kReapTimeout = absl::Seconds(5);
// How long output of exited children is still read (a stray grandchild that
// left its own process group can hold a pipe open).
constexpr absl::Duration kDrainTimeout = absl::Seconds(2);
constexpr absl::Duration kRpcAttempt = absl::Milliseconds(500);
constexpr size_t kMaxLine = 64 * 1024;
constexpr size_t kStderrTail = 8 * 1024;

absl::Status ErrnoError(int error, absl::string_view what) {
  return absl::ErrnoToStatus(error, what);
}

// Writes everything unless the reader is gone; output is best effort.
bool WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p = {fd, POLLOUT, 0};
      if (poll(&p, 1, 1000) <= 0) return false;
    } else {
      return false;
    }
  }
  return true;
}

void CloseFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

absl::Status MakePipe(int fds[2]) {
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoError(errno, "pipe2");
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  return absl::OkStatus();
}

std::vector<std::string> CurrentEnvironment() {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

std::string DirName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::StatusOr<std::string> ResolveExecutable(const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("empty trainer command");
  if (absl::StrContains(name, '/')) return name;  // execve reports what is wrong with it.
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path ? path : "/usr/bin:/bin", ':')) {
    std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", name);
    if (IsExecutableFile(candidate)) return candidate;
  }
  return absl::NotFoundError(absl::StrCat("trainer command \"", name, "\" not found on PATH"));
}

struct SpawnSpec {
  std::string path;
  std::vector<std::string> argv;
  std::vector<std::string> env;
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
};

// fork + execve; the child leads a new process group. Everything the child
// runs before execve is async-signal-safe, as the launcher may have gRPC
// threads. Blocks until the child has exec'ed; returns its errno if that failed.
absl::StatusOr<pid_t> Spawn(const SpawnSpec& spec) {
  std::vector<char*> argv;
  for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int err[2];
  if (pipe2(err, O_CLOEXEC) != 0) return ErrnoError(errno, "pipe2");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close(err[0]);
    close(err[1]);
    return ErrnoError(e, "fork");
  }
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // The launcher died before prctl.
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    const int kReset[] = {SIGINT, SIGTERM, SIGPIPE, SIGCHLD, SIGHUP, SIGQUIT};
    for (int sig : kReset) sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    const int fds[3] = {spec.stdin_fd, spec.stdout_fd, spec.stderr_fd};
    int e = 0;
    for (int i = 0; i < 3 && e == 0; ++i) {
      if (fds[i] == i) {
        fcntl(i, F_SETFD, 0);
      } else if (dup2(fds[i], i) < 0) {
        e = errno;
      }
    }
    if (e == 0) {
      execve(spec.path.c_str(), argv.data(), envp.data());
      e = errno;
    }
    ssize_t ignored = write(err[1], &e, sizeof e);
    (void)ignored;
    _exit(127);
  }
  close(err[1]);
  setpgid(pid, pid);  // Also here, so signals to the group work at once.
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(err[0], &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  close(err[0]);
  if (n == static_cast<ssize_t>(sizeof child_errno)) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return ErrnoError(child_errno, absl::StrCat("cannot run ", spec.path));
  }
  return pid;
}

}  // namespace

// ---------------------------------------------------------------------------
// Helpers.

void LineSplitter::Feed(absl::string_view data, Sink sink) {
  pending_.append(data.data(), data.size());
  const absl::string_view text(pending_);
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') {
      sink(text.substr(start, i + 1 - start));
      start = i + 1;
    } else if (text[i] == '\r') {
      if (i + 1 == text.size()) break;  // Maybe "\r\n": wait for the next byte.
      if (text[i + 1] == '\n') {
        sink(text.substr(start, i + 2 - start));
        start = i + 2;
        ++i;
      } else {
        if (i > start) sink(text.substr(start, i + 1 - start));
        start = i + 1;
      }
    }
  }
  pending_.erase(0, start);
  if (pending_.size() >= kMaxLine) {
    pending_ += '\n';
    sink(pending_);
    pending_.clear();
  }
}

void LineSplitter::Finish(Sink sink) {
  if (!pending_.empty() && pending_ != "\r") {
    pending_ += '\n';
    sink(pending_);
  }
  pending_.clear();
}

namespace {

// A channel's state, as a reason for a health check that got no answer.
const char* ConnectionState(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE:
      return "not connected";
    case GRPC_CHANNEL_CONNECTING:
      return "still connecting";
    case GRPC_CHANNEL_READY:
      return "connected";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "cannot connect: refused, unreachable or the TLS handshake failed";
    case GRPC_CHANNEL_SHUTDOWN:
      return "channel shut down";
  }
  return "unknown connection state";
}

}  // namespace

absl::Status WaitForServing(const std::string& address, const ChannelSecurity& security,
                            const HealthWait& wait) {
  const std::string who = wait.who.empty() ? absl::StrCat("daemon ", address) : wait.who;
  grpc::ChannelArguments args;
  // Retry a refused connection every ~100 ms rather than on gRPC's 1 s+
  // backoff. (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS keeps its default: gRPC
  // takes it as the time one connection attempt may last, TLS handshake
  // included, and a daemon that has just started on a loaded machine can
  // take longer than a short one.)
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  // The standard probe (grpc.health.v1): SERVING once the daemon accepts
  // jobs, NOT_SERVING while it drains.
  const std::shared_ptr<grpc::Channel> channel = MakeChannel(address, security, args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(absl::Now() + kRpcAttempt, wait.deadline)));
    // Waits through connection attempts instead of failing at the first
    // refused one: a connection is only made progress on while a call waits
    // on the channel.
    ctx.set_wait_for_ready(true);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &response);
    if (s.ok()) {
      if (response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        return absl::OkStatus();
      }
      return absl::UnavailableError(
          absl::StrCat(who, " is not serving (health: ",
                       grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()),
                       "; a draining daemon takes no new job)"));
    }
    if (absl::Now() >= wait.deadline) {
      return absl::UnavailableError(absl::StrCat(
          who, " did not answer its health check within ", absl::FormatDuration(wait.timeout), ": ",
          s.error_message(), " (", ConnectionState(channel->GetState(false)), ")"));
    }
    if (wait.between_attempts) {
      RETURN_IF_ERROR(wait.between_attempts());
    } else {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
}

absl::StatusOr<std::vector<std::string>> ParseAddressList(absl::string_view list) {
  std::vector<std::string> out;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) continue;
    if (absl::StartsWith(entry, "unix:/")) {  // a daemon's unix socket
      out.emplace_back(entry);
      continue;
    }
    const size_t colon = entry.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 ||
        !absl::SimpleAtoi(entry.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("daemon address \"", entry, "\" is not HOST:PORT or unix:/PATH"));
    }
    out.emplace_back(entry);
  }
  return out;
}

std::vector<std::string> ZeroshardddCandidates(absl::string_view self_exe,
                                               absl::string_view runfiles_dir,
                                               absl::string_view path_env) {
  std::vector<std::string> out;
  if (!self_exe.empty()) {
    const std::string dir = DirName(self_exe);
    out.push_back(absl::StrCat(dir, "/../server/zeroshardd"));
    out.push_back(absl::StrCat(self_exe, ".runfiles/zeroshard/server/zeroshardd"));
  }
  if (!runfiles_dir.empty()) {
    out.push_back(absl::StrCat(runfiles_dir, "/zeroshard/server/zeroshardd"));
  }
  if (!self_exe.empty()) out.push_back(absl::StrCat(DirName(self_exe), "/zeroshardd"));
  for (absl::string_view dir : absl::StrSplit(path_env, ':', absl::SkipEmpty())) {
    out.push_back(absl::StrCat(dir, "/zeroshardd"));
  }
  return out;
}

absl::StatusOr<std::string> FindZeroshardd(absl::string_view flag) {
  if (!flag.empty()) {
    if (IsExecutableFile(std::string(flag))) return std::string(flag);
    return absl::NotFoundError(absl::StrCat("--zeroshardd=", flag, " is not an executable file"));
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  const std::string self_exe = n > 0 ? std::string(self, n) : std::string();
  const char* runfiles = std::getenv("RUNFILES_DIR");
  if (runfiles == nullptr) runfiles = std::getenv("TEST_SRCDIR");
  const char* path = std::getenv("PATH");
  const std::vector<std::string> candidates =
      ZeroshardddCandidates(self_exe, runfiles ? runfiles : "", path ? path : "");
  for (const std::string& c : candidates) {
    if (IsExecutableFile(c)) return c;
  }
  return absl::NotFoundError(absl::StrCat("zeroshardd not found (pass --zeroshardd=PATH); tried ",
                                          absl::StrJoin(candidates, ", ")));
}

std::vector<std::string> WithNonTemporalThreshold(std::vector<std::string> env, uint64_t bytes) {
  if (bytes == 0) return env;
  constexpr absl::string_view kVar = "GLIBC_TUNABLES=";
  const std::string setting = absl::StrCat(kNonTemporalThresholdTunable, "=", bytes);
  for (std::string& e : env) {
    if (!absl::StartsWith(e, kVar)) continue;
    const absl::string_view tunables = absl::string_view(e).substr(kVar.size());
    if (NonTemporalThresholdIn(tunables).has_value()) return env;
    e = tunables.empty() ? absl::StrCat(kVar, setting) : absl::StrCat(e, ":", setting);
    return env;
  }
  env.push_back(absl::StrCat(kVar, setting));
  return env;
}

absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok) {
    return absl::InternalError(
        absl::StrCat("cannot find a free port on 127.0.0.1: ", std::strerror(error)));
  }
  return ntohs(addr.sin_port);
}

std::vector<std::string> TrainerEnvironment(const std::vector<std::string>& base,
                                            const TrainerEnv& env) {
  std::vector<std::pair<std::string, std::string>> vars = {
      {"ZS_RANK", absl::StrCat(env.rank)},
      {"ZS_WORLD_SIZE", absl::StrCat(env.world_size)},
      {"ZS_DAEMONS", absl::StrJoin(env.daemons, ",")},
      {"ZS_JOB_ID", env.job_id},
      {"ZS_JOB_TOKEN", env.job_token},
      {"ZS_REGISTRATION_TOKEN", env.registration_token},
      {"RANK", absl::StrCat(env.rank)},
      {"WORLD_SIZE", absl::StrCat(env.world_size)},
      {"LOCAL_RANK", absl::StrCat(env.rank)},
      {"LOCAL_WORLD_SIZE", absl::StrCat(env.world_size)},
      {"ZS_RESTART_COUNT", absl::StrCat(env.restart_count)},
  };
  if (!env.metrics_ports.empty()) {
    vars.emplace_back("ZS_METRICS_PORTS", absl::StrJoin(env.metrics_ports, ","));
  }
  if (env.master_port > 0) {
    vars.emplace_back("MASTER_ADDR", env.master_addr);
    vars.emplace_back("MASTER_PORT", absl::StrCat(env.master_port));
  }
  if (!env.collective_dir.empty()) vars.emplace_back("ZS_COLLECTIVE_DIR", env.collective_dir);
  if (!env.transport.empty()) {
    vars.emplace_back("ZS_TRANSPORT", env.transport);
    vars.emplace_back("ZS_UCX_TLS", env.ucx_tls);
  }
  std::vector<std::string> out;
  for (const std::string& entry : base) {
    const absl::string_view key = absl::string_view(entry).substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& v : vars) replaced = replaced || key == v.first;
    // ZS_METRICS_PORTS from an outer launch must not leak in when metrics are off.
    if (!replaced && key != "ZS_METRICS_PORTS") out.push_back(entry);
  }
  for (const auto& v : vars) out.push_back(absl::StrCat(v.first, "=", v.second));
  return out;
}

std::string DefaultJobId() {
  return absl::StrCat("job-", getpid(), "-", absl::ToUnixSeconds(absl::Now()));
}

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

// ---------------------------------------------------------------------------
// Launcher.

Launcher::Launcher(LaunchOptions options) : options_(std::move(options)) {
  if (pipe2(signal_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) signal_pipe_[0] = signal_pipe_[1] = -1;
  devnull_ = open("/dev/null", O_RDWR | O_CLOEXEC);
}

Launcher::~Launcher() {
  // Only reached with children alive if Run itself failed half-way.
  for (auto* procs : {&trainers_, &daemons_}) {
    for (auto& p : *procs) {
      if (p->running) kill(-p->pid, SIGKILL);
    }
    const absl::Time deadline = absl::Now() + kReapTimeout;
    for (auto& p : *procs) {
      while (p->running && absl::Now() < deadline) {
        Reap(*p);
        if (p->running) absl::SleepFor(absl::Milliseconds(10));
      }
    }
  }
  CloseStreams();
  CloseFd(signal_pipe_[0]);
  CloseFd(signal_pipe_[1]);
  CloseFd(devnull_);
}

void Launcher::Interrupt(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  if (signal_pipe_[1] >= 0) {
    ssize_t ignored = write(signal_pipe_[1], &byte, 1);
    (void)ignored;
  }
}

std::vector<pid_t> Launcher::daemon_pids() const {
  std::vector<pid_t> out;
  for (const auto& p : daemons_) out.push_back(p->pid);
  return out;
}

std::vector<pid_t> Launcher::trainer_pids() const {
  std::vector<pid_t> out;
  for (const auto& p : trainers_) out.push_back(p->pid);
  return out;
}

void Launcher::Say(absl::string_view message) {
  WriteAll(options_.stderr_fd, absl::StrCat("[zsrun] ", message, "\n"));
}

bool Launcher::TakeSignal(int* sig) {
  if (signals_taken_ >= pending_signals_.size()) return false;
  *sig = pending_signals_[signals_taken_++];
  return true;
}

void Launcher::Reap(Proc& proc) {
  if (!proc.running) return;
  int status;
  struct rusage usage {};
  const pid_t r = wait4(proc.pid, &status, WNOHANG, &usage);
  if (r == proc.pid) {
    proc.running = false;
    proc.exit_code = ExitCodeOf(status);
    proc.peak_rss_bytes = static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
  } else if (r < 0 && errno == ECHILD) {
    proc.running = false;  // Reaped elsewhere; nothing to wait for.
    proc.exit_code = 1;
  }
}

void Launcher::AddStream(const Proc* owner, int fd, std::string prefix, int out_fd, int log_fd,
                         std::function<void(absl::string_view)> on_line) {
  auto s = std::make_unique<Stream>();
  s->owner = owner;
  s->fd = fd;
  s->prefix = std::move(prefix);
  s->out_fd = out_fd;
  s->log_fd = log_fd;
  s->on_line = std::move(on_line);
  streams_.push_back(std::move(s));
}

void Launcher::ReadStream(Stream& s) {
  char buf[65536];
  const ssize_t n = read(s.fd, buf, sizeof buf);
  auto deliver = [&s](absl::string_view line) {
    if (s.on_line) s.on_line(line);
    if (s.out_fd >= 0) WriteAll(s.out_fd, absl::StrCat(s.prefix, line));
  };
  if (n > 0) {
    const absl::string_view data(buf, n);
    if (s.log_fd >= 0) WriteAll(s.log_fd, data);
    s.splitter.Feed(data, deliver);
  } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
    s.splitter.Finish(deliver);
    CloseFd(s.fd);
    CloseFd(s.log_fd);
  }
}

void Launcher::Pump(absl::Time until) {
  std::vector<pollfd> fds = {{signal_pipe_[0], POLLIN, 0}};
  std::vector<Stream*> polled;
  for (auto& s : streams_) {
    if (s->fd < 0) continue;
    fds.push_back({s->fd, POLLIN, 0});
    polled.push_back(s.get());
  }
  const absl::Duration wait = std::clamp(until - absl::Now(), absl::ZeroDuration(), kTick);
  const int timeout_ms =
      static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))));
  if (poll(fds.data(), fds.size(), timeout_ms) > 0) {
    if (fds[0].revents != 0) {
      unsigned char buf[16];
      ssize_t n;
      while ((n = read(signal_pipe_[0], buf, sizeof buf)) > 0) {
        for (ssize_t i = 0; i < n; ++i) pending_signals_.push_back(buf[i]);
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) ReadStream(*polled[i - 1]);
    }
  }
  for (auto& p : daemons_) Reap(*p);
  for (auto& p : trainers_) Reap(*p);
}

void Launcher::DrainStreams(absl::Time until) {
  while (absl::Now() < until) {
    bool open = false;
    for (const auto& s : streams_) {
      if (s->fd >= 0 && (s->owner == nullptr || !s->owner->running)) open = true;
    }
    if (!open) return;
    Pump(until);
  }
}

void Launcher::CloseStreams() {
  for (auto& s : streams_) {
    if (s->fd < 0) continue;
    s->splitter.Finish([&s](absl::string_view line) {
      if (s->out_fd >= 0) WriteAll(s->out_fd, absl::StrCat(s->prefix, line));
    });
    CloseFd(s->fd);
    CloseFd(s->log_fd);
  }
}

absl::StatusOr<int> Launcher::Run() {
  absl::StatusOr<int> result = RunInternal();
  Stop(trainers_);  // Only error paths get here with trainers running.
  Stop(daemons_);
  if (options_.peak_rss) {
    for (const auto* procs : {&trainers_, &daemons_}) {
      for (const auto& p : *procs) {
        if (p->running) continue;
        Say(absl::StrCat(p->label, " (pid ", p->pid, ") peak RSS ",
                         FormatBytes(static_cast<double>(p->peak_rss_bytes)), " (",
                         p->peak_rss_bytes, " B)"));
      }
    }
  }
  CloseStreams();
  FinishLogDir(result.ok() && *result == 0);
  return result;
}

absl::StatusOr<int> Launcher::RunInternal() {
  if (signal_pipe_[0] < 0 || devnull_ < 0) return absl::InternalError("cannot create pipes");
  const LaunchOptions& o = options_;
  const bool local = o.daemon_addresses.empty();
  if (o.print_daemons) {
    if (!o.command.empty()) {
      return absl::InvalidArgumentError("--print_daemons takes no trainer command");
    }
    if (!local) {
      return absl::InvalidArgumentError(
          "--print_daemons starts daemons; it cannot be used with --daemon_addresses");
    }
  } else {
    if (o.command.empty()) {
      return absl::InvalidArgumentError("no trainer command (zsrun [flags] -- COMMAND [ARGS...])");
    }
    if (o.nproc < 1) return absl::InvalidArgumentError("--nproc must be at least 1");
    if (o.max_restarts < 0) return absl::InvalidArgumentError("--max_restarts must be >= 0");
  }
  if (local && o.daemons < 1) return absl::InvalidArgumentError("--daemons must be at least 1");
  if (o.startup_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--startup_timeout_s must be positive");
  }
  if (o.grace < absl::ZeroDuration()) return absl::InvalidArgumentError("--grace_s must be >= 0");
  if (o.nt_copy_threshold > 0 && o.nt_copy_threshold < kGlibcMinNonTemporalThreshold) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nt_copy_threshold=", o.nt_copy_threshold, ": glibc ignores values under ",
                     kGlibcMinNonTemporalThreshold, "; give 0 (glibc's own) or at least that"));
  }
  if (options_.job_id.empty()) options_.job_id = DefaultJobId();
  job_token_ = JobTokenOrEnvironment("");
  if (job_token_.empty()) {
    ASSIGN_OR_RETURN(job_token_, GenerateToken());
  } else {
    RETURN_IF_ERROR(ValidateToken(job_token_, "ZS_JOB_TOKEN"));
  }

  startup_deadline_ = absl::Now() + o.startup_timeout;
  if (local) {
    RETURN_IF_ERROR(StartDaemons());
  } else {
    addresses_ = o.daemon_addresses;
  }
  if (interrupt_signal_ == 0) RETURN_IF_ERROR(CheckDaemons());
  if (interrupt_signal_ != 0) {
    Say(absl::StrCat("signal ", interrupt_signal_, " during startup; stopping"));
    return 128 + interrupt_signal_;
  }
  if (o.print_daemons) return HoldDaemons();
  return RunTrainers();
}

absl::Status Launcher::PrepareLogDir() {
  if (!options_.log_dir.empty()) {
    log_dir_ = options_.log_dir;
    // mkdir -p: each ancestor, then the directory itself; owner-only, as
    // daemon logs may hold tokens.
    for (size_t slash = log_dir_.find('/', 1);; slash = log_dir_.find('/', slash + 1)) {
      const std::string dir = log_dir_.substr(0, slash);
      struct stat st;
      if (!dir.empty() && mkdir(dir.c_str(), 0700) != 0) {
        const int e = errno;
        if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
          return ErrnoError(e, absl::StrCat("--log_dir: cannot create ", dir));
        }
      }
      if (slash == std::string::npos) break;
    }
    return absl::OkStatus();
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/zsrun-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return ErrnoError(errno, absl::StrCat("cannot create a log directory from ", templ));
  }
  log_dir_ = templ;
  temp_log_dir_ = true;
  return absl::OkStatus();
}

void Launcher::FinishLogDir(bool success) {
  if (log_dir_.empty()) return;
  if (temp_log_dir_ && success) {
    for (const std::string& f : log_files_) unlink(f.c_str());
    // Empty after a good run: each rank removes its rendezvous files.
    if (!collective_dir_.empty()) rmdir(collective_dir_.c_str());
    rmdir(log_dir_.c_str());
    return;
  }
  Say(absl::StrCat("daemon logs are in ", log_dir_));
}

absl::Status Launcher::StartDaemons() {
  ASSIGN_OR_RETURN(const std::string binary, FindZeroshardd(options_.zeroshardd));
  RETURN_IF_ERROR(PrepareLogDir());
  const std::vector<std::string> env =
      WithNonTemporalThreshold(CurrentEnvironment(), options_.nt_copy_threshold);
  // The daemons create jobs only for the run's trainers: a registration
  // token, in an owner-only file for the daemons and ZS_REGISTRATION_TOKEN
  // for the trainers. Not with --print_daemons, whose trainers start
  // elsewhere.
  std::string registration_flag;
  if (!options_.print_daemons) {
    registration_token_ = RegistrationTokenOrEnvironment("");
    if (registration_token_.empty()) {
      ASSIGN_OR_RETURN(registration_token_, GenerateToken());
    } else {
      RETURN_IF_ERROR(ValidateToken(registration_token_, "ZS_REGISTRATION_TOKEN"));
    }
    const std::string path = absl::StrCat(log_dir_, "/registration.token");
    int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    const bool written =
        fd >= 0 && fchmod(fd, 0600) == 0 &&
        write(fd, registration_token_.data(), registration_token_.size()) ==
            static_cast<ssize_t>(registration_token_.size());
    const int e = errno;
    CloseFd(fd);
    if (!written) return ErrnoError(e, absl::StrCat("cannot write ", path));
    log_files_.push_back(path);
    registration_flag = absl::StrCat("--registration_token_file=", path);
  }
  for (int d = 0; d < options_.daemons; ++d) {
    auto proc = std::make_unique<Proc>();
    proc->label = absl::StrCat("daemon ", d);
    const std::string out_path = absl::StrCat(log_dir_, "/daemon-", d, ".stdout.log");
    proc->stderr_path = absl::StrCat(log_dir_, "/daemon-", d, ".stderr.log");
    // Owner-only, also when an earlier run's file is reused; never through a link.
    constexpr int kLogFlags = O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC;
    int out_log = open(out_path.c_str(), kLogFlags, 0600);
    int err_log = open(proc->stderr_path.c_str(), kLogFlags, 0600);
    if (out_log >= 0) fchmod(out_log, 0600);
    if (err_log >= 0) fchmod(err_log, 0600);
    if (out_log < 0 || err_log < 0) {
      const int e = errno;
      CloseFd(out_log);
      CloseFd(err_log);
      return ErrnoError(e, absl::StrCat("cannot create daemon logs in ", log_dir_));
    }
    log_files_.push_back(out_path);
    log_files_.push_back(proc->stderr_path);
    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
    absl::Status piped = MakePipe(out_pipe);
    if (piped.ok() && options_.verbose) piped = MakePipe(err_pipe);
    SpawnSpec spec;
    spec.path = binary;
    spec.argv = {binary, "--listen=127.0.0.1:0"};
    if (options_.metrics) spec.argv.push_back("--metrics_port=0");
    if (!registration_flag.empty()) spec.argv.push_back(registration_flag);
    for (const std::string& a : options_.daemon_args) spec.argv.push_back(a);
    spec.env = env;
    spec.stdin_fd = devnull_;
    spec.stdout_fd = out_pipe[1];
    spec.stderr_fd = options_.verbose ? err_pipe[1] : err_log;
    absl::StatusOr<pid_t> pid = piped.ok() ? Spawn(spec) : absl::StatusOr<pid_t>(piped);
    CloseFd(out_pipe[1]);
    CloseFd(err_pipe[1]);
    if (!options_.verbose) CloseFd(err_log);
    if (!pid.ok()) {
      CloseFd(out_pipe[0]);
      CloseFd(err_pipe[0]);
      CloseFd(out_log);
      CloseFd(err_log);
      return pid.status();
    }
    proc->pid = *pid;
    proc->running = true;
    Proc* raw = proc.get();
    AddStream(raw, out_pipe[0], "", -1, out_log, [raw](absl::string_view line) {
      line = absl::StripTrailingAsciiWhitespace(line);
      if (absl::ConsumePrefix(&line, "zeroshardd listening on ")) {
        raw->address = std::string(line);
      } else if (absl::ConsumePrefix(&line, "zeroshardd metrics on port ")) {
        if (!absl::SimpleAtoi(line, &raw->metrics_port)) raw->metrics_port = 0;
      } else if (absl::ConsumePrefix(&line, "zeroshardd bulk transport ")) {
        const size_t space = line.find(' ');
        raw->bulk_transport = std::string(line.substr(0, space));
        absl::string_view rest = space == line.npos ? "" : line.substr(space + 1);
        if (absl::ConsumePrefix(&rest, "ucx_tls=")) raw->ucx_tls = std::string(rest);
      }
    });
    if (options_.verbose) {
      AddStream(raw, err_pipe[0], absl::StrCat("[daemon ", d, "] "), options_.stderr_fd, err_log,
                nullptr);
    }
    daemons_.push_back(std::move(proc));
  }

  // Each daemon prints its bound address (and metrics port) once serving.
  while (true) {
    const Proc* waiting = nullptr;
    for (const auto& d : daemons_) {
      if (!d->running) {
        return DaemonFailure(
            *d, absl::StrCat("exited with code ", d->exit_code, " before printing its address"));
      }
      if (waiting == nullptr &&
          (d->address.empty() || (options_.metrics && d->metrics_port == 0))) {
        waiting = d.get();
      }
    }
    if (waiting == nullptr) break;
    int sig;
    if (TakeSignal(&sig)) {
      interrupt_signal_ = sig;
      return absl::OkStatus();
    }
    if (absl::Now() >= startup_deadline_) {
      return DaemonFailure(*waiting, absl::StrCat("did not print its address within ",
                                                  absl::FormatDuration(options_.startup_timeout)));
    }
    Pump(startup_deadline_);
  }
  for (const auto& d : daemons_) {
    addresses_.push_back(d->address);
    if (options_.metrics) metrics_ports_.push_back(d->metrics_port);
  }
  // The trainers' data path: the daemons' bulk transport when every one
  // serves the same (a ucx one with the same UCX_TLS), else the streaming
  // RPCs, which every daemon serves (also one that did not say).
  transport_ = "stream";
  ucx_tls_.clear();
  const Proc& first = *daemons_.front();
  bool same = first.bulk_transport == "ucx" || first.bulk_transport == "grpc";
  for (const auto& d : daemons_) {
    same = same && d->bulk_transport == first.bulk_transport && d->ucx_tls == first.ucx_tls;
  }
  if (same) {
    transport_ = first.bulk_transport;
    ucx_tls_ = first.ucx_tls;
  }
  return absl::OkStatus();
}

absl::Status Launcher::CheckDaemons() {
  // TLS as the trainers will use it; the health check needs no token.
  ASSIGN_OR_RETURN(const ChannelSecurity security,
                   MakeChannelSecurity(TlsFilesFromEnvironment({}), "", "ZS_"));
  for (size_t i = 0; i < addresses_.size(); ++i) {
    const std::string& address = addresses_[i];
    const Proc* local = i < daemons_.size() ? daemons_[i].get() : nullptr;
    HealthWait wait;
    wait.deadline = startup_deadline_;
    wait.timeout = options_.startup_timeout;
    if (local != nullptr) {
      wait.who = absl::StrCat(local->label, " (pid ", local->pid, ") at ", address);
    }
    wait.between_attempts = [&]() -> absl::Status {
      Pump(absl::Now() + absl::Milliseconds(100));
      int sig;
      if (TakeSignal(&sig)) {
        interrupt_signal_ = sig;
        return absl::CancelledError("interrupted");
      }
      if (local != nullptr && !local->running) {
        return DaemonFailure(*local, absl::StrCat("exited with code ", local->exit_code,
                                                  " before answering its health check"));
      }
      return absl::OkStatus();
    };
    const absl::Status s = WaitForServing(address, security, wait);
    if (interrupt_signal_ != 0) return absl::OkStatus();
    if (!s.ok()) {
      // A daemon that exited had its stderr printed by DaemonFailure.
      if (local != nullptr && local->running && !options_.verbose) PrintStderrTail(*local);
      return s;
    }
  }
  return absl::OkStatus();
}

void Launcher::PrintStderrTail(const Proc& daemon) {
  const int fd = open(daemon.stderr_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st;
  std::string tail;
  if (fstat(fd, &st) == 0 && st.st_size > 0) {
    const off_t size = st.st_size;
    const off_t from = size > static_cast<off_t>(kStderrTail) ? size - kStderrTail : 0;
    tail.resize(size - from);
    const ssize_t n = pread(fd, tail.data(), tail.size(), from);
    tail.resize(n > 0 ? n : 0);
  }
  close(fd);
  if (tail.empty()) return;
  Say(absl::StrCat(daemon.label, " stderr:"));
  LineSplitter splitter;
  const std::string prefix = absl::StrCat("[", daemon.label, "] ");
  auto sink = [&](absl::string_view line) {
    WriteAll(options_.stderr_fd, absl::StrCat(prefix, line));
  };
  splitter.Feed(tail, sink);
  splitter.Finish(sink);
}

absl::Status Launcher::DaemonFailure(const Proc& daemon, absl::string_view what) {
  // With --verbose the stderr was already shown as it came.
  if (!options_.verbose) PrintStderrTail(daemon);
  return absl::UnavailableError(absl::StrCat(daemon.label, " (pid ", daemon.pid, ") ", what));
}

int Launcher::HoldDaemons() {
  WriteAll(options_.stdout_fd, absl::StrCat("ZS_DAEMONS=", absl::StrJoin(addresses_, ","), "\n"));
  WriteAll(options_.stdout_fd, absl::StrCat("ZS_TRANSPORT=", transport_, "\n"));
  if (transport_ == "ucx") {
    WriteAll(options_.stdout_fd, absl::StrCat("ZS_UCX_TLS=", ucx_tls_, "\n"));
  }
  if (!metrics_ports_.empty()) {
    WriteAll(options_.stdout_fd,
             absl::StrCat("ZS_METRICS_PORTS=", absl::StrJoin(metrics_ports_, ","), "\n"));
  }
  Say(absl::StrCat(daemons_.size(), " daemon(s) running, logs in ", log_dir_,
                   "; SIGINT or SIGTERM stops them"));
  while (true) {
    Pump(absl::Now() + kTick);
    int sig;
    if (TakeSignal(&sig)) return 0;
    for (const auto& d : daemons_) {
      if (!d->running) {
        Say(absl::StrCat(d->label, " exited with code ", d->exit_code));
        if (!options_.verbose) PrintStderrTail(*d);
        return 1;
      }
    }
  }
}

absl::Status Launcher::StartTrainer(int rank, int restarts) {
  auto proc = std::make_unique<Proc>();
  proc->label = absl::StrCat("rank ", rank);
  proc->rank = rank;
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  absl::Status piped = MakePipe(out);
  if (piped.ok()) piped = MakePipe(err);
  TrainerEnv te;
  te.rank = rank;
  te.world_size = options_.nproc;
  te.daemons = addresses_;
  te.job_id = options_.job_id;
  te.job_token = job_token_;
  te.registration_token = registration_token_.empty() ? RegistrationTokenOrEnvironment("")
                                                      : registration_token_;
  te.metrics_ports = metrics_ports_;
  te.restart_count = restarts;
  te.master_port = master_port_;
  te.collective_dir = collective_dir_;
  te.transport = transport_;
  te.ucx_tls = ucx_tls_;
  SpawnSpec spec;
  spec.path = trainer_path_;
  spec.argv = options_.command;
  spec.env = TrainerEnvironment(trainer_base_env_, te);
  spec.stdin_fd = devnull_;
  spec.stdout_fd = out[1];
  spec.stderr_fd = err[1];
  absl::StatusOr<pid_t> pid = piped.ok() ? Spawn(spec) : absl::StatusOr<pid_t>(piped);
  CloseFd(out[1]);
  CloseFd(err[1]);
  if (!pid.ok()) {
    CloseFd(out[0]);
    CloseFd(err[0]);
    return pid.status();  // Run stops the ranks already started.
  }
  proc->pid = *pid;
  proc->running = true;
  const std::string prefix = absl::StrCat("[rank ", rank, "] ");
  AddStream(proc.get(), out[0], prefix, options_.stdout_fd, -1, nullptr);
  AddStream(proc.get(), err[0], prefix, options_.stderr_fd, -1, nullptr);
  trainers_.push_back(std::move(proc));
  return absl::OkStatus();
}

absl::StatusOr<int> Launcher::RunTrainers() {
  ASSIGN_OR_RETURN(trainer_path_, ResolveExecutable(options_.command[0]));
  trainer_base_env_ = WithNonTemporalThreshold(CurrentEnvironment(), options_.nt_copy_threshold);
  rank_restarts_.assign(options_.nproc, 0);
  ASSIGN_OR_RETURN(master_port_, FreeLoopbackPort());
  if (log_dir_.empty()) RETURN_IF_ERROR(PrepareLogDir());  // daemons started elsewhere
  collective_dir_ = absl::StrCat(log_dir_, "/collective");
  if (::mkdir(collective_dir_.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(
        absl::StrCat("cannot make ", collective_dir_, ": ", std::strerror(errno)));
  }
  for (int rank = 0; rank < options_.nproc; ++rank) RETURN_IF_ERROR(StartTrainer(rank, 0));

  int result = 0;
  bool interrupted = false;
  bool killed = false;
  absl::Time kill_at = absl::InfiniteFuture();
  absl::Time give_up = absl::InfiniteFuture();
  auto signal_all = [this](int sig) {
    for (auto& t : trainers_) {
      if (t->running) kill(-t->pid, sig);
    }
  };
  auto stop_all = [&](absl::string_view why) {
    if (kill_at != absl::InfiniteFuture()) return;
    Say(why);
    signal_all(SIGTERM);
    kill_at = absl::Now() + options_.grace;
  };
  while (true) {
    bool running = false;
    for (const auto& t : trainers_) running = running || t->running;
    if (!running) break;
    Pump(absl::Now() + kTick);
    int sig;
    while (TakeSignal(&sig)) {
      if (!interrupted) {
        interrupted = true;
        if (result == 0) result = 128 + sig;
        Say(absl::StrCat("signal ", sig, ": forwarding to the trainers"));
        signal_all(sig);
        kill_at = std::min(kill_at, absl::Now() + options_.grace);
      } else if (!killed) {
        Say(absl::StrCat("signal ", sig, " again: killing the trainers"));
        kill_at = absl::Now();
      }
    }
    // Indices: StartTrainer appends to trainers_.
    for (size_t i = 0; i < trainers_.size(); ++i) {
      Proc& t = *trainers_[i];
      if (t.running || t.seen) continue;
      t.seen = true;
      if (t.exit_code == 0 || result != 0) continue;
      if (!interrupted && kill_at == absl::InfiniteFuture() && restarts_ < options_.max_restarts) {
        // Whatever the failed trainer left in its process group goes first.
        kill(-t.pid, SIGKILL);
        ++restarts_;
        Say(absl::StrCat(t.label, " exited with code ", t.exit_code, "; restarting it (restart ",
                         restarts_, " of ", options_.max_restarts, ")"));
        const int rank = t.rank;
        if (absl::Status s = StartTrainer(rank, ++rank_restarts_[rank]); !s.ok()) {
          result = 1;
          stop_all(absl::StrCat("rank ", rank, " could not be restarted (", s.message(),
                                "); stopping the other trainers"));
        }
        continue;
      }
      result = t.exit_code;
      stop_all(absl::StrCat(t.label, " exited with code ", t.exit_code,
                            "; stopping the other trainers"));
    }
    for (auto& d : daemons_) {
      if (d->running || d->seen) continue;
      d->seen = true;
      if (result == 0) result = 1;
      stop_all(
          absl::StrCat(d->label, " exited with code ", d->exit_code, "; stopping the trainers"));
    }
    const absl::Time now = absl::Now();
    if (!killed && now >= kill_at) {
      killed = true;
      signal_all(SIGKILL);
      give_up = now + kReapTimeout;
    }
    if (now >= give_up) {
      Say("some trainers could not be reaped after SIGKILL; giving up on them");
      break;
    }
  }
  // Whatever a trainer left behind in its process group goes with it.
  for (auto& t : trainers_) {
    if (!t->running) kill(-t->pid, SIGKILL);
  }
  DrainStreams(absl::Now() + kDrainTimeout);
  return result;
}

void Launcher::Stop(std::vector<std::unique_ptr<Proc>>& procs) {
  auto any_running = [&procs] {
    for (const auto& p : procs) {
      if (p->running) return true;
    }
    return false;
  };
  if (any_running()) {
    for (auto& p : procs) {
      if (p->running) kill(-p->pid, SIGTERM);
    }
    const absl::Time deadline = absl::Now() + options_.grace;
    int sig;
    bool hurry = false;
    while (any_running() && absl::Now() < deadline && !hurry) {
      Pump(deadline);
      hurry = TakeSignal(&sig);
    }
    if (any_running()) {
      for (auto& p : procs) {
        if (!p->running) continue;
        if (!hurry) {
          Say(absl::StrCat(p->label, " did not stop within ", absl::FormatDuration(options_.grace),
                           " of SIGTERM; killing it"));
        }
        kill(-p->pid, SIGKILL);
      }
      const absl::Time reap_deadline = absl::Now() + kReapTimeout;
      while (any_running() && absl::Now() < reap_deadline) Pump(reap_deadline);
      for (auto& p : procs) {
        if (p->running) Say(absl::StrCat(p->label, " (pid ", p->pid, ") could not be reaped"));
      }
    }
  }
  DrainStreams(absl::Now() + kDrainTimeout);
}

}  // namespace zeroshard::tools
