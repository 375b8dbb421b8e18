// zsctl: the zeroshard operator tool.
//
//   zsctl estimate --params 7.5e9 --dp 64 [--device_memory 32GiB] [--optimizer_k 12]
//       The paper's model-state memory and communication per rank, stage by stage.
//   zsctl status --daemons HOST:PORT[,HOST:PORT...]
//   zsctl memory --daemons HOST:PORT[,...] [--job J]
//       Bytes by category per job per daemon, next to the paper's formula.

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "tools/zsctl_commands.h"

ABSL_FLAG(std::string, params, "", "Model size Ψ: a count such as 7.5e9, 7.5B, 350M.");
ABSL_FLAG(uint32_t, dp, 1, "Data-parallel degree N_d.");
ABSL_FLAG(std::string, device_memory, "",
          "Device memory for the largest-model column, e.g. 32GiB, 32GB, 80e9.");
ABSL_FLAG(double, optimizer_k, 12, "Optimizer-state bytes per parameter K (12 = mixed-precision Adam).");
ABSL_FLAG(std::string, daemons, "127.0.0.1:7070", "Comma-separated daemon addresses.");
ABSL_FLAG(std::string, job, "", "Only this job (memory).");
ABSL_FLAG(int, timeout_ms, 5000, "Deadline of each RPC.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "zsctl estimate|status|memory [flags]; see --help for the flags of each.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "usage: zsctl estimate|status|memory [flags]\n");
    return 2;
  }
  const std::string command = args[1];
  absl::StatusOr<std::string> out;
  if (command == "estimate") {
    zeroshard::tools::EstimateOptions o;
    o.params = absl::GetFlag(FLAGS_params);
    o.world_size = absl::GetFlag(FLAGS_dp);
    o.device_memory = absl::GetFlag(FLAGS_device_memory);
    o.optimizer_k = absl::GetFlag(FLAGS_optimizer_k);
    out = zeroshard::tools::RunEstimate(o);
  } else if (command == "status" || command == "memory") {
    zeroshard::tools::AdminOptions o;
    o.daemons = absl::GetFlag(FLAGS_daemons);
    o.job = absl::GetFlag(FLAGS_job);
    o.timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
    out = command == "status" ? zeroshard::tools::RunStatus(o) : zeroshard::tools::RunMemory(o);
  } else {
    std::fprintf(stderr, "zsctl: unknown command \"%s\" (estimate, status, memory)\n",
                 command.c_str());
    return 2;
  }
  if (!out.ok()) {
    std::fprintf(stderr, "zsctl %s: %s\n", command.c_str(), out.status().ToString().c_str());
    return 1;
  }
  std::fputs(out->c_str(), stdout);
  return 0;
}
