// zeroshardd: the per-node shard daemon. Owns partitions of model states for
// the jobs registered with it and serves them over gRPC.

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/tls_flags.h"
#include "server/daemon.h"
#include "server/ledger/system_resources.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "HOST:PORT to serve gRPC on; port 0 picks a free port (printed at start). Or "
          "unix:/ABSOLUTE/PATH, a unix socket in a directory of this user's closed to group "
          "and others (mode 0700), which only this user can reach.");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus /metrics endpoint on 127.0.0.1 (only this machine can "
          "scrape it; see --metrics_listen); 0 picks a free port (printed at start); -1 = off.");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT of the /metrics endpoint, e.g. 0.0.0.0:9464 for a Prometheus on another "
          "machine; overrides --metrics_port. /metrics needs no credentials: see "
          "docs/security.md for what it reveals.");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT of a plaintext gRPC server with grpc.health.v1.Health only (SERVING until "
          "drained), for probes that cannot present a client certificate, such as a Kubernetes "
          "gRPC probe against a daemon serving mutual TLS; it reveals only the serving status. "
          "Empty: none.");
ABSL_FLAG(std::string, memory_limit, "auto",
          "Bytes this daemon may hold for all jobs: a number of bytes (suffixes K, M, G, T "
          "for powers of 1024), \"auto\" for 90% of what the machine or this process's cgroup "
          "allows, or 0 for no limit.");
ABSL_FLAG(uint32_t, max_jobs, 64, "Jobs registered at once, at most.");
ABSL_FLAG(uint32_t, max_jobs_per_identity, 32,
          "Jobs one identity may have registered at once: a client certificate's subject under "
          "mutual TLS, else every holder of the registration token together, else every "
          "anonymous caller together (the admin token is exempt); 0: only --max_jobs.");
ABSL_FLAG(std::string, max_memory_per_identity, "0",
          "Bytes the jobs of one identity (as for --max_jobs_per_identity) may hold together "
          "(suffixes K, M, G, T for powers of 1024); 0: only --memory_limit.");
ABSL_FLAG(std::string, max_checkpoint_bytes_per_identity, "0",
          "Bytes the checkpoints of one identity's jobs (as for --max_jobs_per_identity) may take "
          "in --checkpoint_dir (suffixes K, M, G, T); a save past it is refused. 0: no bound.");
ABSL_FLAG(std::string, rpc_memory_bytes, "auto",
          "Bytes gRPC may hold for messages being received, over all connections (each message "
          "is held whole before its handler runs); past it gRPC resets streams "
          "(RESOURCE_EXHAUSTED). Booked at start within --memory_limit. \"auto\": an eighth of "
          "--memory_limit, between 160 MiB and 1 GiB (1 GiB without a limit); 0: unbounded.");
ABSL_FLAG(int, max_rpc_threads, 256,
          "Threads serving gRPC requests, at most: each request in flight holds one, and one "
          "past them is answered RESOURCE_EXHAUSTED. Streams are read only after their token "
          "opened a job here.");
ABSL_FLAG(int, max_calls_per_caller, 0,
          "Calls one caller (the bearer token of its calls: a job's ranks and its daemons share "
          "one) may have in flight at once; one past it is answered RESOURCE_EXHAUSTED before "
          "anything is read. 0: all of --max_rpc_threads but 16 (at least 1), kept for the "
          "operator and other jobs.");
ABSL_FLAG(int, stream_idle_timeout_seconds, 60,
          "A stream whose peer sends (or reads) nothing for this many seconds is cancelled, "
          "releasing its thread and what it reserved; 0: never.");
ABSL_FLAG(bool, insecure, false,
          "Serve plaintext gRPC on an address other machines can reach (without it, a "
          "non-loopback --listen needs --tls_cert/--tls_key/--tls_ca).");
ABSL_FLAG(std::string, admin_token_file, "",
          "File holding the admin secret (mode 0600 or stricter): it opens every job, "
          "Admin.Drain and the all-jobs views of Admin.Status and MemoryReport. Empty: no "
          "caller has that authority.");
ABSL_FLAG(std::string, registration_token_file, "",
          "File holding the deployment's registration secret (mode 0600 or stricter): a "
          "RegisterJob that creates a job must carry it (metadata x-zeroshard-registration; "
          "trainers send ZS_REGISTRATION_TOKEN) or the admin token; ranks of a job already "
          "registered need only the job's token. Empty: any caller may register jobs (up to "
          "--max_jobs).");
ABSL_FLAG(bool, ucx_trust_peers, false,
          "Start the UCX data path even where a peer that reaches UCX can read and write the "
          "daemon's memory beyond the keys it was given: tcp (UCX emulates remote access in "
          "software), RDMA (UCX also serves put and get messages that carry no key), or UCX's "
          "own choice. Without it, UCX starts only when --ucx_tls names shared-memory "
          "transports alone (on a trusted fabric, RDMA needs this flag); otherwise trainers use "
          "the stream data path.");
ABSL_FLAG(int, optimizer_threads, 0,
          "Threads running the optimizer step (1..256); 0 = the CPUs this process may use: its "
          "affinity mask, lowered to its cgroup's CPU limit (cpu.max) rounded up.");
ABSL_FLAG(std::string, optimizer_cpus, "",
          "CPUs to pin the optimizer threads to, one thread per CPU: a Linux CPU list such as "
          "0-7,16 (each CPU in this process's affinity mask), or all (every one of them, at "
          "most 256, whatever CPU quota a cgroup's cpu.max sets). Every optimizer step and "
          "every sum of pushed gradients then runs on all of them, the calling thread waiting, "
          "instead of on threads the scheduler may queue behind each other while a CPU is "
          "idle. For CPUs set aside for the daemon; with --optimizer_threads 0 the thread count "
          "is the CPUs'. Empty: unpinned.");
ABSL_FLAG(std::string, bulk_transport, "ucx",
          "Bulk transport served to trainers (ExchangeEndpoint): ucx, grpc or inproc; empty = "
          "none. When it cannot initialise, the daemon serves the streaming RPCs only and "
          "trainers must use the \"stream\" data path.");
ABSL_FLAG(std::string, bulk_listen_address, "",
          "HOST:PORT the grpc bulk transport (--bulk_transport=grpc) serves regions on; empty: "
          "the host of --listen, port 0 (any free port). A non-loopback address needs mutual "
          "TLS or --insecure, as --listen does. Only for --bulk_transport=grpc. Given and not "
          "servable (in use, not local), the daemon does not start.");
ABSL_FLAG(std::string, advertise_address, "",
          "Host (name or IP address, no port) that trainers and other daemons dial to reach "
          "the grpc bulk transport, handed out in place of its listen host: behind NAT, or "
          "the pod IP in Kubernetes (downward API status.podIP). Empty: the listen host, or, "
          "when that is a wildcard (0.0.0.0, [::]), this machine's primary address (its host "
          "name's address, else the default route's interface); with none found the daemon "
          "refuses to start. With mutual TLS the daemon's certificate must name it. Only for "
          "--bulk_transport=grpc: UCX's worker address lists the interfaces UCX itself chose "
          "(UCX_NET_DEVICES).");
ABSL_FLAG(int, join_timeout_seconds, 120,
          "A job registered here that no rank joins within this many seconds is removed, so "
          "that registrations nobody follows up cannot hold --max_jobs or memory; 0: never.");
ABSL_FLAG(int, liveness_timeout_seconds, 4,
          "A peer daemon (a replica partner, a node cache's owner) that answers no keepalive "
          "ping for this many seconds counts as gone: the calls in flight to it fail, and a "
          "primary goes on with one copy and calls its backup again only once it answers a "
          "probe. Trainers find a silent daemon the same way (4 s). 0: off; else at least 2.");
ABSL_FLAG(int, disk_timeout_seconds, 10,
          "The longest a checkpoint request waits for the daemon's call on --checkpoint_dir (an "
          "owner file, the quota walk, a listing, a manifest): past it the request is answered "
          "UNAVAILABLE and, until "
          "that call returns, every other is refused at once, so a hung disk stalls a "
          "checkpoint save for at most this long. Writes of checkpoint data go on in the "
          "background whatever their length. Spill writes under --spill_dir of which the disk "
          "completes none within it count that disk as hung: nothing is spilled until one "
          "completes, and an offload that needs room is answered UNAVAILABLE (longer than the "
          "write of the largest activation slice).");
ABSL_FLAG(int, job_idle_timeout_seconds, 3600,
          "A job whose ranks have all been silent (no heartbeat, no request) for this many "
          "seconds is removed with its memory, so a crashed run's state stays for the time a "
          "restart needs and not for good. With --checkpoint_dir each daemon first saves its "
          "part of checkpoint idle-step-<committed step> (unless one of that step exists), "
          "which the resumed run's client completes and loads as its latest. 0: never.");
ABSL_FLAG(int, rank_timeout_seconds, 30,
          "A joined rank not heard from (heartbeat, push) this long is no longer connected.");
ABSL_FLAG(uint64_t, reduction_buffer_bytes, 256ull << 20,
          "Out-of-order gradient bytes each job may buffer; pushes past it wait.");
ABSL_FLAG(uint32_t, staging_slots, 4,
          "Slots in each joined rank's staging region (1..64), each one bucket (C_B, at most "
          "64 MiB) or this daemon's share of the parameters in fp32 if smaller, booked as the "
          "job's buffer memory: how many of a rank's bulk pushes may be in flight to this "
          "daemon at once. Fewer slots save memory; more let a rank's Puts overlap the "
          "daemon's sums of earlier buckets.");
ABSL_FLAG(int, reduction_hold_ms, 50,
          "Up to this long a staged gradient push of one bucket (of the last micro-batch) whose "
          "range still "
          "waits for other ranks is held in its staging slot, so that the range's last "
          "contribution sums them all in one pass instead of one pass each (0: sum each as it "
          "comes). The push's answer waits meanwhile; the rank's other staging slots go on.");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self",
          "UCX_TLS for the UCX data path: \"posix,cma,self\" (shared memory, trainers on this "
          "host), RDMA such as \"rc_x,sm,self\", or \"tcp\"; empty = UCX's choice. Anything "
          "but shared memory starts only with --ucx_trust_peers: over tcp (or UCX's choice) UCX "
          "emulates remote access in software, and beside RDMA it serves put and get messages "
          "that carry no key.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for checkpoints (created if missing); empty: checkpoints are refused. "
          "Resharding reads other daemons' parts: share it between the daemons of a job.");
ABSL_FLAG(uint64_t, activation_arena_bytes, 256ull << 20,
          "Bytes of the activation-checkpoint arena, allocated (and booked against "
          "--memory_limit) at start; 0 = no Activation service.");
ABSL_FLAG(std::string, spill_dir, "",
          "Directory for activation slices that do not fit the arena (created if missing; spill "
          "files of killed daemons are removed at start); empty = no spilling.");
ABSL_FLAG(uint64_t, spill_bytes, 4ull << 30, "Bytes of spill files at most (with --spill_dir).");
ABSL_FLAG(std::string, state_dir, "",
          "Directory (local NVMe) for jobs' fp32 masters and optimizer moments that do not fit "
          "in --state_memory (created if missing; state files of killed daemons are removed at "
          "start); empty = all model states in RAM. Replicated jobs stay in RAM.");
ABSL_FLAG(bool, state_gradients, false,
          "With --state_dir: the gradient accumulators of jobs whose states are on disk are "
          "file mappings there too, which the kernel writes back and evicts under memory "
          "pressure (4 bytes per owned parameter out of RAM).");
ABSL_FLAG(uint64_t, state_disk_limit, 0,
          "With --state_dir: bytes all jobs' files there may take together (a job that would "
          "pass it is refused); 0 = as much as the disk holds.");
ABSL_FLAG(uint64_t, state_memory, 0,
          "With --state_dir: bytes of fp32 masters and moments that jobs may keep in RAM; a "
          "job whose states do not fit beside the others' goes to --state_dir.");
ABSL_FLAG(int, drain_seconds, 10, "On SIGTERM, how long in-flight requests may finish.");

namespace {
volatile std::sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }
// A quota flag's bytes: as --memory_limit takes them, but not "auto".
absl::StatusOr<uint64_t> ParseQuotaBytes(const std::string& text, absl::string_view flag) {
  if (text == "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": expected a number of bytes (suffixes K, M, G, T) or 0, got auto"));
  }
  absl::StatusOr<uint64_t> bytes = zeroshard::ParseMemoryLimit(text, flag);
  if (bytes.ok()) return bytes;
  return absl::InvalidArgumentError(absl::StrCat(
      flag, ": expected 0 (no bound) or a number of bytes with an optional suffix K, M, G or T "
      "(powers of 1024), got \"", text, "\""));
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("zeroshardd --listen=HOST:PORT [--memory_limit=BYTES] ...");
  absl::ParseCommandLine(argc, argv);
  zeroshard::DaemonOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  absl::StatusOr<uint64_t> memory_limit =
      zeroshard::ParseMemoryLimit(absl::GetFlag(FLAGS_memory_limit), "--memory_limit");
  if (!memory_limit.ok()) {
    std::fprintf(stderr, "zeroshardd: %s\n", memory_limit.status().ToString().c_str());
    return 1;
  }
  options.memory_limit_bytes = *memory_limit;
  options.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  if (const std::string rpc = absl::GetFlag(FLAGS_rpc_memory_bytes); rpc == "auto") {
    options.rpc_memory_bytes = zeroshard::AutoRpcMemoryBytes(options.memory_limit_bytes);
  } else {
    absl::StatusOr<uint64_t> bytes = ParseQuotaBytes(rpc, "--rpc_memory_bytes");
    if (!bytes.ok()) {
      std::fprintf(stderr, "zeroshardd: %s\n", bytes.status().ToString().c_str());
      return 1;
    }
    options.rpc_memory_bytes = *bytes;
  }
  options.max_jobs_per_identity = absl::GetFlag(FLAGS_max_jobs_per_identity);
  absl::StatusOr<uint64_t> identity_memory = ParseQuotaBytes(
      absl::GetFlag(FLAGS_max_memory_per_identity), "--max_memory_per_identity");
  if (!identity_memory.ok()) {
    std::fprintf(stderr, "zeroshardd: %s\n", identity_memory.status().ToString().c_str());
    return 1;
  }
  options.max_memory_per_identity = *identity_memory;
  absl::StatusOr<uint64_t> identity_disk =
      ParseQuotaBytes(absl::GetFlag(FLAGS_max_checkpoint_bytes_per_identity),
                      "--max_checkpoint_bytes_per_identity");
  if (!identity_disk.ok()) {
    std::fprintf(stderr, "zeroshardd: %s\n", identity_disk.status().ToString().c_str());
    return 1;
  }
  options.max_checkpoint_bytes_per_identity = *identity_disk;
  options.max_rpc_threads = absl::GetFlag(FLAGS_max_rpc_threads);
  options.max_calls_per_caller = absl::GetFlag(FLAGS_max_calls_per_caller);
  options.stream_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_stream_idle_timeout_seconds));
  options.tls = zeroshard::TlsFilesFromFlags();
  options.insecure = absl::GetFlag(FLAGS_insecure);
  options.ucx_trust_peers = absl::GetFlag(FLAGS_ucx_trust_peers);
  if (const std::string file = absl::GetFlag(FLAGS_admin_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = zeroshard::ReadTokenFile(file, "--admin_token_file");
    if (!token.ok()) {
      std::fprintf(stderr, "zeroshardd: %s\n", token.status().ToString().c_str());
      return 1;
    }
    options.admin_token = *std::move(token);
  }
  if (const std::string file = absl::GetFlag(FLAGS_registration_token_file); !file.empty()) {
    absl::StatusOr<std::string> token =
        zeroshard::ReadTokenFile(file, "--registration_token_file");
    if (!token.ok()) {
      std::fprintf(stderr, "zeroshardd: %s\n", token.status().ToString().c_str());
      return 1;
    }
    options.registration_token = *std::move(token);
  }
  options.optimizer_threads = absl::GetFlag(FLAGS_optimizer_threads);
  if (!absl::GetFlag(FLAGS_optimizer_cpus).empty()) {
    absl::StatusOr<std::vector<int>> cpus = zeroshard::ParseCpuList(
        absl::GetFlag(FLAGS_optimizer_cpus), zeroshard::AffinityCpuList(), "--optimizer_cpus");
    if (!cpus.ok()) {
      std::fprintf(stderr, "zeroshardd: %s\n", cpus.status().ToString().c_str());
      return 1;
    }
    options.optimizer_cpus = *std::move(cpus);
    if (options.optimizer_threads == 0) {
      options.optimizer_threads = static_cast<int>(options.optimizer_cpus.size());
    }
  }
  if (options.optimizer_threads == 0) {
    options.optimizer_threads = zeroshard::DefaultOptimizerThreads();
  }
  options.bulk_transport = absl::GetFlag(FLAGS_bulk_transport);
  options.rank_timeout = absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_seconds));
  options.join_timeout = absl::Seconds(absl::GetFlag(FLAGS_join_timeout_seconds));
  options.job_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_job_idle_timeout_seconds));
  options.liveness_timeout = absl::Seconds(absl::GetFlag(FLAGS_liveness_timeout_seconds));
  options.reduction_buffer_bytes = absl::GetFlag(FLAGS_reduction_buffer_bytes);
  options.reduction_hold = absl::Milliseconds(absl::GetFlag(FLAGS_reduction_hold_ms));
  options.staging_slots = absl::GetFlag(FLAGS_staging_slots);
  options.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  options.bulk_listen = absl::GetFlag(FLAGS_bulk_listen_address);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.disk_timeout = absl::Seconds(absl::GetFlag(FLAGS_disk_timeout_seconds));
  options.activation_arena_bytes = absl::GetFlag(FLAGS_activation_arena_bytes);
  options.spill_dir = absl::GetFlag(FLAGS_spill_dir);
  options.spill_bytes = absl::GetFlag(FLAGS_spill_bytes);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.state_memory_bytes = absl::GetFlag(FLAGS_state_memory);
  options.state_gradients = absl::GetFlag(FLAGS_state_gradients);
  options.state_disk_limit_bytes = absl::GetFlag(FLAGS_state_disk_limit);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  if (options.metrics_listen.empty() && absl::GetFlag(FLAGS_metrics_port) >= 0) {
    options.metrics_listen = absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_metrics_port));
  }
  auto daemon = zeroshard::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "zeroshardd: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  // What trainers may use besides the streaming RPCs (zsrun passes it on as
  // ZS_TRANSPORT and ZS_UCX_TLS): before the address, which launchers wait
  // for.
  const zeroshard::transport::Transport* transport = (*daemon)->bulk_transport();
  if (const absl::string_view bulk = transport ? transport->kind() : ""; bulk.empty()) {
    std::printf("zeroshardd bulk transport none\n");
  } else if (bulk == "ucx") {
    std::printf("zeroshardd bulk transport ucx ucx_tls=%s\n", options.ucx_tls.c_str());
  } else {
    std::printf("zeroshardd bulk transport %.*s\n", static_cast<int>(bulk.size()), bulk.data());
  }
  std::printf("zeroshardd listening on %s\n", (*daemon)->address().c_str());
  std::printf("zeroshardd serving %s\n", options.tls.enabled() ? "mutual TLS" : "plaintext");
  std::printf("zeroshardd memory limit %s\n",
              options.memory_limit_bytes == 0
                  ? "none"
                  : absl::StrCat(options.memory_limit_bytes, " bytes").c_str());
  std::printf("zeroshardd optimizer threads %d%s\n", options.optimizer_threads,
              options.optimizer_cpus.empty()
                  ? ""
                  : absl::StrCat(" pinned to CPUs ", zeroshard::FormatCpuList(options.optimizer_cpus))
                        .c_str());
  if ((*daemon)->metrics_port() != 0) {
    std::printf("zeroshardd metrics on port %d\n", (*daemon)->metrics_port());
  }
  if ((*daemon)->health_port() != 0) {
    std::printf("zeroshardd health checks (plaintext) on port %d\n", (*daemon)->health_port());
  }
  std::fflush(stdout);
  // A file-size limit makes writes past it fail (EFBIG: a checkpoint save
  // reports ResourceExhausted) instead of killing the daemon.
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  while (g_signal == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::fprintf(stderr, "zeroshardd: signal %d, draining for up to %ds\n", static_cast<int>(g_signal),
               absl::GetFlag(FLAGS_drain_seconds));
  (*daemon)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  (*daemon)->Wait();
  std::fprintf(stderr, "zeroshardd: stopped\n");
  return 0;
}
