// zsctl: the zeroshard operator tool.
//
//   zsctl estimate --params 7.5e9 --dp 64 [--device_memory 32GiB] [--optimizer_k 12]
//                  [--daemons N]
//       The paper's model-state memory and communication per rank, stage by stage;
//       then one daemon's share when N daemons (default: --dp) shard the job, in
//       RAM or with --state_dir.
//   zsctl status --daemons HOST:PORT[,HOST:PORT...]
//   zsctl memory --daemons HOST:PORT[,...] [--job J]
//       Bytes by category per job per daemon, next to the paper's formula.
//   zsctl health --daemons HOST:PORT[,...] [--timeout_ms 30000]
//       Waits until every daemon answers its gRPC health check as SERVING;
//       exit 0, or 1 naming the daemon that is not serving or did not answer.
//   zsctl checkpoint save|load|list|verify --daemons HOST:PORT[,...] --job J [--name N]
//       Checkpoints of a job on its daemons (--daemons: the job's, in its order).
//       save: the committed step under N; load: N or "latest" into the job;
//       list: the complete checkpoints; verify: every CRC-32C of N (default latest).
//   zsctl export --checkpoint DIR/JOB/NAME --out model.pt
//       A checkpoint's fp32 masters as a dict {tensor name: tensor} that
//       Python's torch.load reads (NAME may be "latest"); reads files only.
//   --output=json (estimate, status, memory): one JSON document on stdout, for
//       scripts; its keys are in tools/zsctl_commands.h.
//   --tls_cert/--tls_key/--tls_ca (or ZS_TLS_*): mutual TLS to the daemons.
//       Without them a token goes only to loopback daemons, unless --insecure
//       (or ZS_INSECURE=1) says plaintext on the network is wanted.

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/auth.h"
#include "common/channel.h"
#include "common/tls_flags.h"
#include "tools/export_lib.h"
#include "tools/zsctl_commands.h"

ABSL_FLAG(std::string, params, "", "Model size Ψ: a count such as 7.5e9, 7.5B, 350M.");
ABSL_FLAG(uint32_t, dp, 1, "Data-parallel degree N_d.");
ABSL_FLAG(std::string, device_memory, "",
          "Device memory for the largest-model column, e.g. 32GiB, 32GB, 80e9.");
ABSL_FLAG(double, optimizer_k, 12, "Optimizer-state bytes per parameter K (12 = mixed-precision Adam).");
ABSL_FLAG(std::string, daemons, "",
          "Comma-separated daemon addresses (default 127.0.0.1:7070); estimate: the number "
          "of daemons sharding the job (default --dp).");
ABSL_FLAG(std::string, job, "", "Only this job (memory); the job (checkpoint).");
ABSL_FLAG(std::string, name, "",
          "Checkpoint name (checkpoint save, load, verify; load and verify also take "
          "\"latest\").");
ABSL_FLAG(std::string, checkpoint, "",
          "export: the checkpoint directory DIR/JOB/NAME (DIR: the daemons' --checkpoint_dir; "
          "NAME may be \"latest\").");
ABSL_FLAG(std::string, out, "", "export: the file to write, e.g. model.pt.");
ABSL_FLAG(int, timeout_ms, 0,
          "Deadline: of each RPC for status and memory (0: 5000), of the whole command for "
          "health (0: 30000) and checkpoint (0: 600000; saves, loads and verifies of large "
          "models read or write everything).");

ABSL_FLAG(std::string, output, "text",
          "text, or json for one JSON document on stdout (estimate, status, memory): "
          "snake_case keys as the protobuf fields, numbers without units, one entry per "
          "daemon with its data or its error.");

ABSL_FLAG(std::string, token_file, "",
          "File (mode 0600) holding the job's token, or the admin token; default: "
          "$ZS_JOB_TOKEN. Without one, daemons show no job and refuse job commands.");

ABSL_FLAG(bool, insecure, false,
          "Send the token in plaintext to daemons that are not on loopback (no --tls_* files; "
          "also ZS_INSECURE=1): for networks where something else protects the traffic.");

namespace {

constexpr char kUsage[] =
    "usage: zsctl estimate|status|memory|health|drain|token|export [flags]\n"
    "       zsctl checkpoint save|load|list|verify [flags]\n"
    "       --output=json: estimate, status and memory print one JSON document\n";

// --daemons as the daemons' addresses.
std::string DaemonAddresses() {
  const std::string daemons = absl::GetFlag(FLAGS_daemons);
  return daemons.empty() ? "127.0.0.1:7070" : daemons;
}

int TimeoutMs(int default_ms) {
  const int t = absl::GetFlag(FLAGS_timeout_ms);
  return t == 0 ? default_ms : t;
}

// The credentials from --token_file / $ZS_JOB_TOKEN and --tls_* / $ZS_TLS_*.
absl::StatusOr<zeroshard::ChannelSecurity> Security() {
  std::string token;
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    absl::StatusOr<std::string> t = zeroshard::ReadTokenFile(file, "--token_file");
    if (!t.ok()) return t.status();
    token = *std::move(t);
  }
  return zeroshard::MakeChannelSecurity(
      zeroshard::TlsFilesFromFlags(),
      zeroshard::JobTokenOrEnvironment(token), "--");
}

// Sets `*security` from the flags, then returns `run()`; the credentials'
// error (and no call) when the flags' files cannot be read, or when a token
// would go in plaintext to one of `daemons` that is not on loopback without
// --insecure.
absl::StatusOr<std::string> Secured(const std::string& daemons,
                                    zeroshard::ChannelSecurity* security,
                                    absl::FunctionRef<absl::StatusOr<std::string>()> run) {
  absl::StatusOr<zeroshard::ChannelSecurity> s = Security();
  if (!s.ok()) return s.status();
  if (!s->token.empty()) {
    const bool insecure = zeroshard::InsecureOrEnvironment(absl::GetFlag(FLAGS_insecure));
    for (absl::string_view address : absl::StrSplit(daemons, ',', absl::SkipEmpty())) {
      if (absl::Status plain = zeroshard::CheckPlaintextAddress(
              address, s->tls, insecure, "--daemons",
              "--tls_cert, --tls_key and --tls_ca (or ZS_TLS_CERT, ZS_TLS_KEY and ZS_TLS_CA)",
              "--insecure (or ZS_INSECURE=1)");
          !plain.ok()) {
        return plain;
      }
    }
  }
  *security = *std::move(s);
  return run();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "zsctl estimate|status|memory|health|drain|token|export [flags]\n"
      "zsctl checkpoint save|load|list|verify [flags]\n"
      "--output=json: estimate, status and memory print one JSON document.\n"
      "see --help for the flags of each.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  std::string command = args[1];
  const size_t expected_args = command == "checkpoint" ? 3 : 2;
  if (args.size() != expected_args) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  absl::StatusOr<zeroshard::tools::OutputFormat> format =
      zeroshard::tools::ParseOutputFormat(absl::GetFlag(FLAGS_output));
  if (!format.ok()) {
    std::fprintf(stderr, "zsctl: %s\n", std::string(format.status().message()).c_str());
    std::fputs(kUsage, stderr);
    return 2;
  }
  const bool json = *format == zeroshard::tools::OutputFormat::kJson;
  const bool known = command == "estimate" || command == "status" || command == "memory" ||
                     command == "health" || command == "drain" || command == "token" ||
                     command == "checkpoint" || command == "export";
  if (json && known && !zeroshard::tools::SupportsJson(command)) {
    std::fprintf(stderr, "zsctl %s: --output=json is for %s only; %s prints text\n",
                 command.c_str(), zeroshard::tools::kJsonCommands, command.c_str());
    std::fputs(kUsage, stderr);
    return 2;
  }
  absl::StatusOr<std::string> out;
  // --output=json, a daemon failed: the document, printed before the error.
  std::string document;
  if (command == "estimate") {
    zeroshard::tools::EstimateOptions o;
    o.params = absl::GetFlag(FLAGS_params);
    o.world_size = absl::GetFlag(FLAGS_dp);
    o.device_memory = absl::GetFlag(FLAGS_device_memory);
    o.optimizer_k = absl::GetFlag(FLAGS_optimizer_k);
    o.daemons = absl::GetFlag(FLAGS_daemons);
    out = json ? zeroshard::tools::RunEstimateJson(o) : zeroshard::tools::RunEstimate(o);
  } else if (command == "token") {
    out = zeroshard::tools::RunToken();
  } else if (command == "status" || command == "memory" || command == "drain") {
    zeroshard::tools::AdminOptions o;
    o.daemons = DaemonAddresses();
    o.job = absl::GetFlag(FLAGS_job);
    o.timeout_ms = TimeoutMs(5000);
    out = Secured(o.daemons, &o.security, [&]() -> absl::StatusOr<std::string> {
      if (!json) {
        return command == "status"   ? zeroshard::tools::RunStatus(o)
               : command == "memory" ? zeroshard::tools::RunMemory(o)
                                     : zeroshard::tools::RunDrain(o);
      }
      const absl::Status s = command == "status" ? zeroshard::tools::RunStatusJson(o, &document)
                                                 : zeroshard::tools::RunMemoryJson(o, &document);
      if (!s.ok()) return s;
      return std::exchange(document, std::string());
    });
  } else if (command == "health") {
    zeroshard::tools::AdminOptions o;
    o.daemons = DaemonAddresses();
    o.timeout_ms = TimeoutMs(30000);
    out = Secured(o.daemons, &o.security, [&] { return zeroshard::tools::RunHealth(o); });
  } else if (command == "checkpoint") {
    zeroshard::tools::CheckpointOptions o;
    o.daemons = DaemonAddresses();
    o.job = absl::GetFlag(FLAGS_job);
    o.name = absl::GetFlag(FLAGS_name);
    o.timeout_ms = TimeoutMs(600000);
    const std::string action = args[2];
    command = absl::StrCat(command, " ", action);
    out = Secured(o.daemons, &o.security,
                  [&] { return zeroshard::tools::RunCheckpoint(action, o); });
  } else if (command == "export") {
    zeroshard::tools::ExportOptions o;
    o.checkpoint = absl::GetFlag(FLAGS_checkpoint);
    o.out = absl::GetFlag(FLAGS_out);
    out = zeroshard::tools::RunExport(o);
  } else {
    std::fprintf(stderr,
                 "zsctl: unknown command \"%s\" (estimate, status, memory, health, drain, token, "
                 "checkpoint, export)\n",
                 command.c_str());
    return 2;
  }
  if (!out.ok()) {
    std::fputs(document.c_str(), stdout);
    std::fflush(stdout);
    std::fprintf(stderr, "zsctl %s: %s\n", command.c_str(), out.status().ToString().c_str());
    return 1;
  }
  std::fputs(out->c_str(), stdout);
  return 0;
}
