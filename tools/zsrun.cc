// zsrun: runs a zeroshard training job on one machine, like torchrun.
//
//   zsrun [--daemons=D] [--nproc=N] [flags] -- TRAINER_COMMAND [ARGS...]
//   zsrun --daemon_addresses=HOST:PORT,... --nproc=N -- TRAINER_COMMAND ...
//   zsrun --daemons=D --print_daemons
//
// Exit code: the first non-zero trainer exit code (128+S for a trainer killed
// by signal S), 128+S when zsrun itself got signal S, 1 when zsrun could not
// start or a daemon died, 2 for bad flags, else 0.

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "tools/zsrun_lib.h"

ABSL_FLAG(int, daemons, 1, "Local zeroshardd processes to start (on 127.0.0.1, free ports).");
ABSL_FLAG(std::string, daemon_addresses, "",
          "Comma-separated HOST:PORT of running daemons to use instead of starting any.");
ABSL_FLAG(std::string, zeroshardd, "",
          "The daemon binary. Default: the first executable of <dir of zsrun>/../server/zeroshardd "
          "(bazel-bin), <zsrun>.runfiles/zeroshard/server/zeroshardd, "
          "$RUNFILES_DIR/zeroshard/server/zeroshardd, <dir of zsrun>/zeroshardd, then $PATH.");
ABSL_FLAG(std::string, daemon_args, "",
          "Extra zeroshardd flags, split on whitespace (no quoting), after zsrun's own.");
ABSL_FLAG(bool, metrics, false,
          "Start daemons with --metrics_port=0 and give trainers ZS_METRICS_PORTS.");
ABSL_FLAG(int, nproc, 1, "Trainer processes to start.");
ABSL_FLAG(int, max_restarts, 0,
          "Trainer failures to survive in all: a trainer that exits non-zero is started again "
          "as the same rank (ZS_RESTART_COUNT one higher) while the others keep running.");
ABSL_FLAG(std::string, job_id, "", "ZS_JOB_ID for the trainers; default job-<pid>-<unix time>.");
ABSL_FLAG(
    double, startup_timeout_s, 30,
    "Seconds for the daemons to print their address and answer their gRPC health check (SERVING).");
ABSL_FLAG(double, grace_s, 10, "Seconds between SIGTERM and SIGKILL when stopping a process.");
ABSL_FLAG(std::string, log_dir, "",
          "Directory for daemon-D.stdout.log/daemon-D.stderr.log; default a temporary directory, "
          "removed when the job succeeds.");
ABSL_FLAG(bool, verbose, false, "Also show daemon stderr, as [daemon D] lines.");
ABSL_FLAG(bool, peak_rss, false,
          "After the run, print each trainer's and daemon's peak resident set size (ru_maxrss).");
ABSL_FLAG(bool, print_daemons, false,
          "Start the daemons, print ZS_DAEMONS=... and ZS_TRANSPORT=... (ZS_UCX_TLS=... with "
          "ucx), and keep them until SIGINT/SIGTERM.");
ABSL_FLAG(uint64_t, nt_copy_threshold, zeroshard::tools::kNonTemporalCopyThreshold,
          "Bytes above which glibc's memcpy uses non-temporal stores in the daemons and trainers "
          "started (glibc.cpu.x86_non_temporal_threshold in GLIBC_TUNABLES, unless that sets it "
          "already); 0 leaves glibc's own, which it derives from the L3 size the CPU reports. "
          "glibc ignores values under 16448, so those are refused.");

namespace {

constexpr char kUsage[] =
    R"(runs a zeroshard job on this machine.

  zsrun [flags] -- TRAINER_COMMAND [ARGS...]

Starts --daemons zeroshardd processes (or checks --daemon_addresses), waits
until each answers its gRPC health check as SERVING, then starts --nproc copies of
TRAINER_COMMAND with ZS_RANK, ZS_WORLD_SIZE, ZS_DAEMONS, ZS_JOB_ID,
ZS_JOB_TOKEN, ZS_RESTART_COUNT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE (and ZS_METRICS_PORTS with
--metrics; with daemons it started, ZS_TRANSPORT and ZS_UCX_TLS: the bulk
transport every daemon serves, else "stream", which zeroshard.torch's
init_from_env uses) set, and daemons and trainers with glibc's non-temporal copy
threshold at --nt_copy_threshold in GLIBC_TUNABLES (unless that sets it). Trainer stdout/stderr lines are prefixed "[rank N] "; a
lone "\r" (a progress bar) also ends a line and is kept, so bars redraw in
place. Trainers read stdin from /dev/null.

When a trainer exits non-zero the others get SIGTERM, then SIGKILL after
--grace_s, and zsrun exits with that code; with --max_restarts=N the first N
such failures instead start that rank again (ZS_RESTART_COUNT one higher):
it rejoins the job as a new incarnation and continues at the committed
step, while the other ranks wait for it within their step timeout. SIGINT/SIGTERM are forwarded to
the trainers (a second one kills them); zsrun then exits 128+signal. The
daemons zsrun started are stopped last.

  zsrun --daemons=2 --print_daemons
prints ZS_DAEMONS=... (and ZS_TRANSPORT=..., with ucx ZS_UCX_TLS=...) and
keeps the daemons until Ctrl-C, for trainers started elsewhere with
--daemon_addresses.)";

zeroshard::tools::Launcher* g_launcher = nullptr;

void OnSignal(int sig) {
  if (g_launcher != nullptr) g_launcher->Interrupt(sig);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);

  zeroshard::tools::LaunchOptions options;
  options.daemons = absl::GetFlag(FLAGS_daemons);
  const std::string addresses = absl::GetFlag(FLAGS_daemon_addresses);
  if (!addresses.empty()) {
    auto parsed = zeroshard::tools::ParseAddressList(addresses);
    if (!parsed.ok() || parsed->empty()) {
      std::fprintf(stderr, "zsrun: --daemon_addresses: %s\n",
                   parsed.ok() ? "no address" : std::string(parsed.status().message()).c_str());
      return 2;
    }
    options.daemon_addresses = *std::move(parsed);
  }
  options.zeroshardd = absl::GetFlag(FLAGS_zeroshardd);
  options.daemon_args =
      absl::StrSplit(absl::GetFlag(FLAGS_daemon_args), absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
  options.metrics = absl::GetFlag(FLAGS_metrics);
  options.nproc = absl::GetFlag(FLAGS_nproc);
  options.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  options.job_id = absl::GetFlag(FLAGS_job_id);
  options.command.assign(args.begin() + 1, args.end());
  options.startup_timeout = absl::Seconds(absl::GetFlag(FLAGS_startup_timeout_s));
  options.grace = absl::Seconds(absl::GetFlag(FLAGS_grace_s));
  options.log_dir = absl::GetFlag(FLAGS_log_dir);
  options.verbose = absl::GetFlag(FLAGS_verbose);
  options.peak_rss = absl::GetFlag(FLAGS_peak_rss);
  options.print_daemons = absl::GetFlag(FLAGS_print_daemons);
  options.nt_copy_threshold = absl::GetFlag(FLAGS_nt_copy_threshold);

  zeroshard::tools::Launcher launcher(std::move(options));
  g_launcher = &launcher;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  // A closed stdout must not kill zsrun before it has stopped its children.
  std::signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<int> code = launcher.Run();

  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  g_launcher = nullptr;
  if (!code.ok()) {
    std::fprintf(stderr, "zsrun: %s\n", std::string(code.status().message()).c_str());
    return code.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return *code;
}
