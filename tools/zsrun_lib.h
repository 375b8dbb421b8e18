#pragma once

// The launcher behind zsrun (torchrun for zeroshard on one machine): starts
// local zeroshardd daemons or checks remote ones, runs N trainer processes
// with the ZS_* environment, streams their output with a rank prefix and
// tears everything down. zsrun's main() only parses flags into LaunchOptions.
//
// Process model: every child (daemon or trainer) leads its own process group,
// so a terminal's Ctrl-C reaches only the launcher, which forwards it. Signals
// to a child go to its whole group (a trainer's `sh -c` and what it started).
// Children get PR_SET_PDEATHSIG(SIGTERM), so they are not left behind if the
// launcher is killed outright. Trainers read stdin from /dev/null.

#include <sys/types.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/channel.h"

namespace zeroshard::tools {

// The non-temporal copy threshold zsrun gives the processes it starts: 4
// MiB. glibc derives its own from the L3 size the CPU reports (glibc 2.36:
// three quarters of each CPU's share of it): on a VM with a few CPUs of a
// host with hundreds of MiB of L3 it lands at hundreds of MiB, and copies of
// tens of MiB (staging slots, arena slices, UCX's shared-memory puts and
// gets) then read every destination line before writing it.
inline constexpr uint64_t kNonTemporalCopyThreshold = 4ull << 20;

struct LaunchOptions {
  // Local daemons to start; ignored when daemon_addresses is set.
  int daemons = 1;
  // HOST:PORT of running daemons to use instead of starting any.
  std::vector<std::string> daemon_addresses;
  // The daemon binary; empty: FindZeroshardd's search.
  std::string zeroshardd;
  // Extra daemon flags, appended after --listen/--metrics_port (so they win).
  std::vector<std::string> daemon_args;
  // Start daemons with --metrics_port=0 and export ZS_METRICS_PORTS.
  bool metrics = false;
  int nproc = 1;
  // Trainer failures survived in all (torchrun's --max_restarts, per trainer
  // rather than per group): a trainer that exits non-zero (or dies of a
  // signal) while no stop is under way is started again as the same rank,
  // with ZS_RESTART_COUNT one higher, and the others keep running; it joins
  // the job as a new incarnation and continues at the committed step. Past
  // this many, a failure stops the run as without it.
  int max_restarts = 0;
  // Empty: DefaultJobId().
  std::string job_id;
  // The trainer's argv; argv[0] without a '/' is looked up on PATH.
  std::vector<std::string> command;
  // Bounds reading each daemon's address and its Admin.Status answer.
  absl::Duration startup_timeout = absl::Seconds(30);
  // SIGTERM to SIGKILL, for trainers and for daemons.
  absl::Duration grace = absl::Seconds(10);
  // Where daemon-D.stdout.log / daemon-D.stderr.log go (created if missing).
  // Empty: a fresh temporary directory, removed when the run succeeds.
  std::string log_dir;
  // Also echo daemon stderr as "[daemon D] ..." lines.
  bool verbose = false;
  // After the run, say each process's peak resident set size (its
  // ru_maxrss, as wait4 reports it when the process is reaped).
  bool peak_rss = false;
  // Start the daemons, print ZS_DAEMONS=..., and hold them until a signal.
  // Takes no command.
  bool print_daemons = false;
  // glibc's threshold above which memcpy writes with non-temporal stores,
  // for every daemon and trainer started (GLIBC_TUNABLES, see
  // WithNonTemporalThreshold); 0 leaves glibc's own. Run() refuses 1 to
  // 16447, which glibc would ignore.
  uint64_t nt_copy_threshold = kNonTemporalCopyThreshold;
  // Where prefixed trainer stdout, and trainer stderr plus the launcher's own
  // messages, are written (blocking writes). Not closed. If one is a pipe, the
  // caller should ignore SIGPIPE, as zsrun does.
  int stdout_fd = STDOUT_FILENO;
  int stderr_fd = STDERR_FILENO;
};

// One launch. Run() once; the destructor kills and reaps anything still
// running (only after an error inside Run itself).
class Launcher {
 public:
  explicit Launcher(LaunchOptions options);
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // Blocks until the trainers are done (or the daemons, with print_daemons)
  // and every child zsrun started is reaped. Returns the exit code zsrun
  // should end with:
  //   0            every trainer exited 0 (print_daemons: stopped by a signal);
  //   c            the first non-zero trainer code, 128+S for signal S;
  //   128+S        interrupted by signal S (see Interrupt) before a failure;
  //   1            a daemon zsrun started died while trainers ran.
  // Errors: InvalidArgument for bad options; NotFound for a missing daemon or
  // trainer binary; Unavailable when a daemon did not start or answer
  // Admin.Status within startup_timeout (its stderr is printed first);
  // Internal for failing system calls.
  absl::StatusOr<int> Run();

  // Async-signal-safe; any thread. The first call forwards `sig` to the
  // trainers and starts the grace period; a second one kills them at once.
  // Before the trainers start it aborts the startup.
  void Interrupt(int sig);

  // The daemons in use (after Run has checked them), in ZS_DAEMONS order.
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Where the daemon logs went; empty when no daemons were started. A
  // temporary one no longer exists after a run that returned 0.
  const std::string& log_dir() const { return log_dir_; }
  // Pids of the processes Run started (restarted trainers after the first
  // nproc); all reaped once Run returns.
  std::vector<pid_t> daemon_pids() const;
  std::vector<pid_t> trainer_pids() const;

 private:
  struct Proc;
  struct Stream;

  // Each phase returns early with interrupt_signal_ set when interrupted.
  absl::StatusOr<int> RunInternal();
  absl::Status PrepareLogDir();
  absl::Status StartDaemons();
  absl::Status CheckDaemons();
  int HoldDaemons();
  absl::StatusOr<int> RunTrainers();
  // Starts rank `rank`'s trainer (its `restarts`-th restart) and appends it
  // to trainers_.
  absl::Status StartTrainer(int rank, int restarts);
  // SIGTERM, `grace`, SIGKILL, then reaps (bounded); each step skipped once
  // nothing is left running.
  void Stop(std::vector<std::unique_ptr<Proc>>& procs);
  void FinishLogDir(bool success);

  // Waits up to `until`, but at most one short tick, for output, signals and
  // exits, and handles them.
  void Pump(absl::Time until);
  void ReadStream(Stream& stream);
  void Reap(Proc& proc);
  void AddStream(const Proc* owner, int fd, std::string prefix, int out_fd, int log_fd,
                 std::function<void(absl::string_view)> on_line);
  // Reads until the streams of exited processes reach end of file, or `until`.
  void DrainStreams(absl::Time until);
  void CloseStreams();
  // Prints the daemon's stderr and returns Unavailable("daemon D <what>").
  absl::Status DaemonFailure(const Proc& daemon, absl::string_view what);
  void PrintStderrTail(const Proc& daemon);
  void Say(absl::string_view message);
  bool TakeSignal(int* sig);

  LaunchOptions options_;
  int signal_pipe_[2] = {-1, -1};
  int devnull_ = -1;
  std::vector<int> pending_signals_;
  size_t signals_taken_ = 0;
  int interrupt_signal_ = 0;
  absl::Time startup_deadline_;
  std::vector<std::unique_ptr<Proc>> daemons_;
  // Every trainer process started, restarted ones after the first nproc.
  std::vector<std::unique_ptr<Proc>> trainers_;
  std::string trainer_path_;
  std::vector<std::string> trainer_base_env_;
  int restarts_ = 0;                // trainer restarts so far
  std::vector<int> rank_restarts_;  // by rank: ZS_RESTART_COUNT of its latest process
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<std::string> addresses_;
  std::vector<int> metrics_ports_;
  // The daemons' data path for the trainers (ZS_TRANSPORT, ZS_UCX_TLS);
  // empty when zsrun started no daemons (the caller's variables stay).
  std::string transport_;
  std::string ucx_tls_;
  // The job's secret handed to every trainer: ZS_JOB_TOKEN from zsrun's own
  // environment, else a fresh one per run.
  std::string job_token_;
  // The registration token zsrun's own daemons demand (--registration_token_file
  // in the log directory); empty with --print_daemons or external daemons.
  std::string registration_token_;
  std::string log_dir_;
  bool temp_log_dir_ = false;
  // The run's torch.distributed rendezvous port and trainer-collective
  // directory (under the log directory), the same for every rank.
  int master_port_ = 0;
  std::string collective_dir_;
  std::vector<std::string> log_files_;
};

// Cuts a byte stream into lines for prefixing. A line ends at "\n", "\r\n"
// or a lone "\r" (a progress bar redrawing itself), and is passed on with its
// terminator, so "[rank 0] 40%\r" still redraws in place. Empty "\r" segments
// are dropped; a line longer than 64 KiB is cut with an added "\n".
class LineSplitter {
 public:
  using Sink = absl::FunctionRef<void(absl::string_view line)>;
  void Feed(absl::string_view data, Sink sink);
  // At end of stream: passes on a partial line with "\n" appended.
  void Finish(Sink sink);

 private:
  std::string pending_;
};

// How WaitForServing waits on one daemon.
struct HealthWait {
  // Gives up at this time.
  absl::Time deadline;
  // What a timeout's message says was waited for ("within 30s").
  absl::Duration timeout;
  // Names the daemon in messages; empty: "daemon ADDRESS".
  std::string who;
  // Runs after each attempt that got no answer and should take about 100 ms
  // (the launcher pumps its children's output there); a non-OK status from
  // it is returned at once. Empty: sleeps 100 ms.
  std::function<absl::Status()> between_attempts;
};

// Calls grpc.health.v1.Health/Check on `address` (no token needed; TLS as
// `security` says) until it answers, each call waiting up to 500 ms for a
// connection, which is retried about every 100 ms while refused. Blocks the
// calling thread. OK once the daemon answers SERVING. Unavailable "<who> is
// not serving (health: NOT_SERVING; ...)" when it answers anything else (a
// draining daemon), Unavailable "<who> did not answer its health check
// within <timeout>: <last gRPC error> (<connection state>)" at the deadline.
absl::Status WaitForServing(const std::string& address, const ChannelSecurity& security,
                            const HealthWait& wait);

// "h:p,h:p" -> addresses; InvalidArgument for an entry without a numeric port.
absl::StatusOr<std::vector<std::string>> ParseAddressList(absl::string_view list);

// Where zsrun looks for zeroshardd, in order: `<dir of self_exe>/../server/`
// (bazel-bin layout), `<self_exe>.runfiles/zeroshard/server/`,
// `<runfiles_dir>/zeroshard/server/` (if set), `<dir of self_exe>/` (installed
// side by side), then each PATH entry.
std::vector<std::string> ZeroshardddCandidates(absl::string_view self_exe,
                                               absl::string_view runfiles_dir,
                                               absl::string_view path_env);

// `flag` if set (NotFound unless executable), else the first executable
// candidate for /proc/self/exe, $RUNFILES_DIR (or $TEST_SRCDIR) and $PATH;
// NotFound naming the places tried.
absl::StatusOr<std::string> FindZeroshardd(absl::string_view flag);

// What a trainer sees on top of the launcher's environment.
struct TrainerEnv {
  int rank = 0;
  int world_size = 1;
  std::vector<std::string> daemons;
  std::string job_id;
  std::string job_token;           // the run's secret, ZS_JOB_TOKEN
  // The daemons' registration token, ZS_REGISTRATION_TOKEN (empty: set empty).
  std::string registration_token;
  std::vector<int> metrics_ports;  // empty: ZS_METRICS_PORTS not set
  int restart_count = 0;           // ZS_RESTART_COUNT: times this rank was restarted
  // What torchrun gives its trainers for torch.distributed's env://
  // rendezvous (MASTER_ADDR, MASTER_PORT; port 0: not set), and the trainer
  // collective's rendezvous directory (ZS_COLLECTIVE_DIR; empty: not set).
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string collective_dir;
  // The data path of the daemons zsrun started, which zeroshard.torch's
  // init_from_env takes as the client's transport and ucx_tls: ZS_TRANSPORT
  // ("ucx" or "grpc" when every daemon serves it, else "stream") and
  // ZS_UCX_TLS (the daemons' UCX_TLS; empty: UCX's choice). Empty
  // `transport`: neither is set (the launcher's own values stay).
  std::string transport;
  std::string ucx_tls;
};

// `base` ("K=V" entries) with ZS_RANK, ZS_WORLD_SIZE, ZS_DAEMONS, ZS_JOB_ID,
// ZS_JOB_TOKEN, ZS_REGISTRATION_TOKEN, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, ZS_RESTART_COUNT
// (and ZS_METRICS_PORTS, MASTER_ADDR with MASTER_PORT, ZS_COLLECTIVE_DIR,
// ZS_TRANSPORT with ZS_UCX_TLS)
// replacing any earlier values.
std::vector<std::string> TrainerEnvironment(const std::vector<std::string>& base,
                                            const TrainerEnv& env);

// A TCP port on 127.0.0.1 that was free when asked (bound and released: the
// run's trainers bind it next, as torchrun's static rendezvous does).
absl::StatusOr<int> FreeLoopbackPort();

// `env` ("K=V" entries) with glibc.cpu.x86_non_temporal_threshold=`bytes`
// in GLIBC_TUNABLES (added to the tunables already there). Unchanged when
// `bytes` is 0 or GLIBC_TUNABLES sets that tunable already (the caller's
// choice wins).
std::vector<std::string> WithNonTemporalThreshold(std::vector<std::string> env, uint64_t bytes);

// "job-<pid>-<unix seconds>".
std::string DefaultJobId();

// waitpid status -> exit code; 128+S for a process killed by signal S.
int ExitCodeOf(int wait_status);

}  // namespace zeroshard::tools
