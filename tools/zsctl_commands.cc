#include "tools/zsctl_commands.h"

#include <cctype>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/checkpoint_driver.h"
#include "client/daemon_control.h"
#include "client/rpc.h"
#include "common/auth.h"
#include "common/checkpoint_files.h"
#include "common/estimator.h"
#include "common/format.h"
#include "common/job_id.h"
#include "common/job_spec.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "tools/json_output.h"
#include "tools/zsrun_lib.h"

namespace zeroshard::tools {
namespace {

// Splits "7.5GiB" into 7.5 and "gib".
absl::Status SplitNumber(absl::string_view text, double* value, std::string* suffix) {
  text = absl::StripAsciiWhitespace(text);
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.' ||
                             text[i] == 'e' || text[i] == 'E' || text[i] == '+' ||
                             text[i] == '-')) {
    // 'e' followed by a digit or sign is an exponent; otherwise it starts a suffix.
    if ((text[i] == 'e' || text[i] == 'E') &&
        (i + 1 >= text.size() ||
         !(std::isdigit(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '+' ||
           text[i + 1] == '-'))) {
      break;
    }
    ++i;
  }
  if (i == 0 || !absl::SimpleAtod(text.substr(0, i), value) || !std::isfinite(*value) ||
      *value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is not a positive number"));
  }
  *suffix = absl::AsciiStrToLower(text.substr(i));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<double> ParseCount(absl::string_view text) {
  double v;
  std::string suffix;
  if (absl::Status s = SplitNumber(text, &v, &suffix); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--params: ", s.message()));
  }
  if (suffix.empty()) return v;
  if (suffix == "k") return v * 1e3;
  if (suffix == "m") return v * 1e6;
  if (suffix == "b" || suffix == "g") return v * 1e9;
  if (suffix == "t") return v * 1e12;
  return absl::InvalidArgumentError(
      absl::StrCat("--params: unknown suffix \"", suffix, "\" (use K, M, B or T)"));
}

absl::StatusOr<double> ParseBytes(absl::string_view text) {
  double v;
  std::string suffix;
  if (absl::Status s = SplitNumber(text, &v, &suffix); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--device_memory: ", s.message()));
  }
  static const struct {
    const char* suffix;
    double scale;
  } kUnits[] = {{"", 1},     {"b", 1},           {"kb", 1e3},       {"mb", 1e6},
                {"gb", 1e9}, {"tb", 1e12},       {"kib", 1024.0},   {"mib", 1048576.0},
                {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  for (const auto& u : kUnits) {
    if (suffix == u.suffix) return v * u.scale;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--device_memory: unknown unit \"", suffix, "\" (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"));
}

namespace {

constexpr const char* kStageNames[] = {"baseline DP", "P_os", "P_os+g", "P_os+g+p"};
constexpr const char* kStageFormulas[] = {"(4+K)Ψ", "4Ψ+KΨ/N_d", "2Ψ+(2+K)Ψ/N_d", "(4+K)Ψ/N_d"};

struct EstimateInput {
  double psi = 0;
  double device_bytes = 0;  // 0: no --device_memory
  uint32_t daemons = 0;     // --daemons, or the world size
};

absl::StatusOr<EstimateInput> CheckEstimateOptions(const EstimateOptions& options) {
  if (options.params.empty()) {
    return absl::InvalidArgumentError("--params is required, e.g. --params 7.5e9");
  }
  EstimateInput in;
  absl::StatusOr<double> psi = ParseCount(options.params);
  if (!psi.ok()) return psi.status();
  in.psi = *psi;
  if (!options.device_memory.empty()) {
    absl::StatusOr<double> d = ParseBytes(options.device_memory);
    if (!d.ok()) return d.status();
    in.device_bytes = *d;
  }
  in.daemons = options.world_size;
  if (!options.daemons.empty()) {
    const absl::string_view text = absl::StripAsciiWhitespace(options.daemons);
    if (!absl::SimpleAtoi(text, &in.daemons) || in.daemons == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--daemons: estimate takes the number of daemons (>= 1), got \"", text, "\""));
    }
  }
  return in;
}

// The block after the stage table: one daemon's share, in RAM or with
// --state_dir.
std::string DaemonBlock(const DaemonStateEstimate& e, const EstimateInput& in) {
  return absl::StrFormat(
      "\nPer daemon (D = %u daemon%s, Ψ/D = %s owned parameters each):\n"
      "  RAM %s (all model states in RAM: (K+4+2)Ψ/D)\n"
      "  with --state_dir: RAM %s + NVMe %s ((4+2)Ψ/D + %s of chunk buffers, KΨ/D)\n"
      "  with --state_dir --state_gradients: RAM %s + NVMe %s (2Ψ/D + the buffers, "
      "(K+4)Ψ/D)\n",
      in.daemons, in.daemons == 1 ? "" : "s", FormatCount(in.psi / in.daemons),
      FormatBytes(e.ram_bytes), FormatBytes(e.state_dir_ram_bytes),
      FormatBytes(e.state_dir_disk_bytes),
      absl::StrCat(kStateDirBufferBytes / (1 << 20), " MiB"),
      FormatBytes(e.state_gradients_ram_bytes), FormatBytes(e.state_gradients_disk_bytes));
}

// A byte count or element count as a whole number (as a double past 2^64).
Json Whole(double value) {
  const double r = std::round(value);
  if (r >= 0 && r < 18446744073709551616.0) return static_cast<uint64_t>(r);
  return JsonNumber(r);
}

}  // namespace

absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view text) {
  if (text == "text") return OutputFormat::kText;
  if (text == "json") return OutputFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("--output: must be text or json, got \"", text, "\""));
}

bool SupportsJson(absl::string_view command) {
  return command == "estimate" || command == "status" || command == "memory";
}

absl::StatusOr<std::string> RunEstimate(const EstimateOptions& options) {
  absl::StatusOr<EstimateInput> in = CheckEstimateOptions(options);
  if (!in.ok()) return in.status();
  const double device = in->device_bytes;
  std::string out = absl::StrFormat(
      "Model states per rank for Ψ = %s parameters, N_d = %u, K = %s\n"
      "(ZeRO paper, mixed-precision training; decimal units, 3 significant figures)\n\n",
      FormatCount(in->psi), options.world_size, FormatSig3(options.optimizer_k));
  absl::StrAppend(&out, PadRight("stage", 16), PadRight("formula", 15), PadLeft("params", 10),
                  PadLeft("grads", 10), PadLeft("optimizer", 10), PadLeft("total", 10),
                  PadLeft("comm/step", 13));
  if (device > 0) absl::StrAppend(&out, PadLeft("max Ψ", 9));
  out += "\n";
  for (int stage = 0; stage <= 3; ++stage) {
    auto e = EstimateModelStates(stage, in->psi, options.world_size, options.optimizer_k);
    if (!e.ok()) return e.status();
    absl::StrAppend(
        &out, PadRight(absl::StrCat(stage, "  ", kStageNames[stage]), 16),
        PadRight(kStageFormulas[stage], 15), PadLeft(FormatBytes(e->param_bytes), 10),
        PadLeft(FormatBytes(e->grad_bytes), 10), PadLeft(FormatBytes(e->optimizer_bytes), 10),
        PadLeft(FormatBytes(e->bytes_per_rank), 10),
        PadLeft(absl::StrCat(stage == 3 ? "3Ψ " : "2Ψ ", FormatBytes(e->comm_bytes)), 13));
    if (device > 0) {
      auto max = MaxParameters(stage, device, options.world_size, options.optimizer_k);
      if (!max.ok()) return max.status();
      absl::StrAppend(&out, PadLeft(FormatCount(*max), 9));
    }
    out += "\n";
  }
  if (device > 0) {
    absl::StrAppendFormat(&out, "\nmax Ψ: largest model whose states fit %s per device.\n",
                          FormatBytes(device));
  }
  absl::StatusOr<DaemonStateEstimate> d =
      EstimateDaemonStates(in->psi, in->daemons, options.optimizer_k);
  if (!d.ok()) return d.status();
  absl::StrAppend(&out, DaemonBlock(*d, *in));
  return out;
}

absl::StatusOr<std::string> RunEstimateJson(const EstimateOptions& options) {
  absl::StatusOr<EstimateInput> in = CheckEstimateOptions(options);
  if (!in.ok()) return in.status();
  Json doc;
  doc["parameters"] = JsonNumber(in->psi);
  doc["world_size"] = options.world_size;
  doc["optimizer_k"] = JsonNumber(options.optimizer_k);
  doc["device_memory_bytes"] = in->device_bytes > 0 ? Whole(in->device_bytes) : Json();
  doc["stages"] = Json::array();
  for (int stage = 0; stage <= 3; ++stage) {
    auto e = EstimateModelStates(stage, in->psi, options.world_size, options.optimizer_k);
    if (!e.ok()) return e.status();
    Json s;
    s["stage"] = stage;
    s["name"] = kStageNames[stage];
    s["formula"] = kStageFormulas[stage];
    s["param_bytes"] = Whole(e->param_bytes);
    s["grad_bytes"] = Whole(e->grad_bytes);
    s["optimizer_bytes"] = Whole(e->optimizer_bytes);
    s["model_state_bytes"] = Whole(e->bytes_per_rank);
    s["comm_elements"] = Whole(e->comm_elements);
    s["comm_bytes_per_step"] = Whole(e->comm_bytes);
    s["max_parameters"] = nullptr;
    if (in->device_bytes > 0) {
      auto max = MaxParameters(stage, in->device_bytes, options.world_size, options.optimizer_k);
      if (!max.ok()) return max.status();
      s["max_parameters"] = JsonNumber(*max);
    }
    doc["stages"].push_back(std::move(s));
  }
  absl::StatusOr<DaemonStateEstimate> d =
      EstimateDaemonStates(in->psi, in->daemons, options.optimizer_k);
  if (!d.ok()) return d.status();
  Json& daemon = doc["daemon"];
  daemon["daemons"] = in->daemons;
  daemon["ram_bytes"] = Whole(d->ram_bytes);
  daemon["state_dir_ram_bytes"] = Whole(d->state_dir_ram_bytes);
  daemon["state_dir_disk_bytes"] = Whole(d->state_dir_disk_bytes);
  daemon["state_gradients_ram_bytes"] = Whole(d->state_gradients_ram_bytes);
  daemon["state_gradients_disk_bytes"] = Whole(d->state_gradients_disk_bytes);
  return JsonDocument(doc);
}

namespace {

std::vector<std::string> DaemonList(const std::string& daemons) {
  std::vector<std::string> out;
  for (absl::string_view d : absl::StrSplit(daemons, ',', absl::SkipWhitespace())) {
    out.emplace_back(absl::StripAsciiWhitespace(d));
  }
  return out;
}

std::unique_ptr<v1::Admin::Stub> AdminStub(const std::string& address,
                                           const ChannelSecurity& security) {
  return v1::Admin::NewStub(MakeDaemonChannel(address, security));
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& address) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("daemon ", address, ": ", s.error_message()));
}

}  // namespace

namespace {

// A daemon's Status, and the step state of options.job if it runs that job.
struct DaemonStatus {
  v1::StatusResponse status;
  std::optional<v1::StepState> job_state;
};

absl::StatusOr<DaemonStatus> GetDaemonStatus(const std::string& address,
                                             const AdminOptions& options) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(options.timeout_ms));
  DaemonStatus d;
  grpc::Status s =
      AdminStub(address, options.security)->Status(&ctx, v1::StatusRequest(), &d.status);
  if (!s.ok()) return FromGrpc(s, address);
  for (const v1::JobStatus& j : d.status.jobs()) {
    if (options.job.empty() || j.job_id() != options.job) continue;
    DaemonControl daemon(address, MakeDaemonChannel(address, options.security));
    absl::StatusOr<v1::StepState> state =
        daemon.GetStepState(options.job, absl::Now() + absl::Milliseconds(options.timeout_ms));
    if (!state.ok()) return state.status();
    d.job_state = *std::move(state);
  }
  return d;
}

// For zsctl status --job: each rank as the daemon sees it, and what its open
// step waits for.
std::string RankLines(const std::string& address, const v1::StepState& state) {
  std::string out;
  for (const v1::RankState& r : state.ranks()) {
    const std::string heard = r.seconds_since_heard() < 0
                                  ? std::string("never heard from")
                                  : absl::StrFormat("heard %.1fs ago", r.seconds_since_heard());
    absl::StrAppendFormat(&out, "    rank %-4u %-12s incarnation %u  %s  last step pushed %u\n",
                          r.rank(),
                          !r.joined()     ? "not joined"
                          : r.connected() ? "connected"
                                          : "DISCONNECTED",
                          r.incarnation(), heard, r.last_step_pushed());
  }
  absl::StrAppendFormat(&out, "    open step %u: %s, %u of %u elements complete\n",
                        state.committed_step() + 1, state.prepared() ? "prepared" : "pushing",
                        state.complete_elements(), state.owned_elements());
  if (const std::string waits = DescribeWaits(address, state); !waits.empty()) {
    absl::StrAppend(&out, "    ", waits, "\n");
  }
  return out;
}

// The job's "ranks" and "open_step" members of *job.
void WriteStepState(const v1::StepState& state, Json* job) {
  Json& ranks = (*job)["ranks"] = Json::array();
  for (const v1::RankState& r : state.ranks()) {
    Json rank;
    rank["rank"] = r.rank();
    rank["joined"] = r.joined();
    rank["connected"] = r.connected();
    rank["incarnation"] = r.incarnation();
    rank["seconds_since_heard"] = JsonNumber(r.seconds_since_heard());
    rank["last_step_pushed"] = r.last_step_pushed();
    ranks.push_back(std::move(rank));
  }
  Json& open = (*job)["open_step"];
  open["step"] = state.committed_step() + 1;
  open["prepared"] = state.prepared();
  open["complete_elements"] = state.complete_elements();
  open["owned_elements"] = state.owned_elements();
  Json& missing = open["missing"] = Json::array();
  for (const v1::MissingContribution& m : state.missing()) {
    Json entry;
    entry["rank"] = m.rank();
    entry["begin"] = m.range().begin();
    entry["end"] = m.range().end();
    entry["contributions"] = m.contributions();
    entry["expected"] = m.expected();
    missing.push_back(std::move(entry));
  }
}

// {"daemons": [...]}: each daemon's entry, {"address"} and what write(data,
// &entry) adds, from fetch(address), or its {"address", "error"}. Returns the
// first error.
template <typename T>
absl::Status WriteDaemons(const AdminOptions& options,
                          const std::function<absl::StatusOr<T>(const std::string& address)>& fetch,
                          const std::function<void(const T&, Json*)>& write,
                          std::string* document) {
  absl::Status first_error;
  Json doc;
  Json& daemons = doc["daemons"] = Json::array();
  for (const std::string& address : DaemonList(options.daemons)) {
    Json entry;
    entry["address"] = address;
    absl::StatusOr<T> data = fetch(address);
    if (data.ok()) {
      write(*data, &entry);
    } else {
      entry["error"]["code"] = absl::StatusCodeToString(data.status().code());
      entry["error"]["message"] = std::string(data.status().message());
      first_error.Update(data.status());
    }
    daemons.push_back(std::move(entry));
  }
  *document = JsonDocument(doc);
  return first_error;
}

}  // namespace

absl::StatusOr<std::string> RunStatus(const AdminOptions& options) {
  std::string out;
  for (const std::string& address : DaemonList(options.daemons)) {
    absl::StatusOr<DaemonStatus> d = GetDaemonStatus(address, options);
    if (!d.ok()) return d.status();
    const v1::StatusResponse& resp = d->status;
    absl::StrAppendFormat(&out, "daemon %s  version %s  up %.0fs%s  jobs %d\n", address,
                          resp.version(), resp.uptime_seconds(),
                          resp.draining() ? "  DRAINING" : "", resp.jobs_size());
    for (const auto& j : resp.jobs()) {
      std::string parts;
      for (uint32_t p : j.owned_partitions()) absl::StrAppend(&parts, parts.empty() ? "" : ",", p);
      absl::StrAppendFormat(&out,
                            "  job %-20s stage %u  N_d %u  ranks %u/%u  step %u  Ψ %s  "
                            "partitions [%s]\n",
                            j.job_id(), j.stage(), j.world_size(), j.ranks_connected(),
                            j.world_size(), j.committed_step(), FormatCount(j.parameters()),
                            parts);
      if (j.has_replica()) {
        const v1::ReplicaGroupState& r = j.replica();
        absl::StrAppendFormat(
            &out, "    replica group %u: %s at epoch %u, %s (peer %s)\n", r.group(),
            r.role() == v1::REPLICA_ROLE_PRIMARY ? "primary" : "backup", r.epoch(),
            r.role() == v1::REPLICA_ROLE_PRIMARY
                ? (r.in_sync() ? "backup in sync" : "NO CURRENT BACKUP")
                : (r.in_sync() ? "in sync" : "NOT CURRENT"),
            r.peer_address());
      }
      if (j.job_id() == options.job && d->job_state.has_value() &&
          (!j.has_replica() || j.replica().group() == d->job_state->replica().group())) {
        absl::StrAppend(&out, RankLines(address, *d->job_state));
      }
    }
  }
  return out;
}

absl::Status RunStatusJson(const AdminOptions& options, std::string* document) {
  return WriteDaemons<DaemonStatus>(
      options, [&](const std::string& address) { return GetDaemonStatus(address, options); },
      [&](const DaemonStatus& d, Json* daemon) {
        (*daemon)["version"] = d.status.version();
        (*daemon)["uptime_seconds"] = JsonNumber(d.status.uptime_seconds());
        (*daemon)["draining"] = d.status.draining();
        Json& jobs = (*daemon)["jobs"] = Json::array();
        for (const v1::JobStatus& j : d.status.jobs()) {
          Json job;
          job["job_id"] = j.job_id();
          job["stage"] = j.stage();
          job["world_size"] = j.world_size();
          job["ranks_connected"] = j.ranks_connected();
          job["committed_step"] = j.committed_step();
          job["parameters"] = j.parameters();
          job["owned_partitions"] = Json::array();
          for (uint32_t p : j.owned_partitions()) job["owned_partitions"].push_back(p);
          if (j.job_id() == options.job && d.job_state.has_value()) {
            WriteStepState(*d.job_state, &job);
          }
          jobs.push_back(std::move(job));
        }
      },
      document);
}

absl::StatusOr<std::string> RunDrain(const AdminOptions& options) {
  std::string out;
  for (const std::string& address : DaemonList(options.daemons)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options.timeout_ms));
    v1::DrainResponse resp;
    grpc::Status s = v1::Control::NewStub(MakeDaemonChannel(address, options.security))
                         ->Drain(&ctx, v1::DrainRequest(), &resp);
    if (!s.ok()) return FromGrpc(s, address);
    absl::StrAppendFormat(&out, "daemon %s draining: takes no new jobs, %u running\n", address,
                          resp.jobs());
  }
  return out;
}

absl::StatusOr<std::string> RunHealth(const AdminOptions& options) {
  const std::vector<std::string> addresses = DaemonList(options.daemons);
  if (addresses.empty()) {
    return absl::InvalidArgumentError(
        "--daemons is required: the daemons to wait for, e.g. --daemons=node0:7070,node1:7070");
  }
  for (const std::string& a : addresses) {
    if (absl::Status s = ValidateHostPort(a, "--daemons"); !s.ok()) return s;
  }
  if (options.timeout_ms <= 0) return absl::InvalidArgumentError("--timeout_ms must be positive");
  HealthWait wait;
  wait.timeout = absl::Milliseconds(options.timeout_ms);
  wait.deadline = absl::Now() + wait.timeout;
  std::string out;
  for (const std::string& address : addresses) {
    if (absl::Status s = WaitForServing(address, options.security, wait); !s.ok()) return s;
    absl::StrAppend(&out, "daemon ", address, " serving\n");
  }
  return out;
}

absl::StatusOr<std::string> RunToken() {
  absl::StatusOr<std::string> token = GenerateToken();
  if (!token.ok()) return token.status();
  return absl::StrCat(*token, "\n");
}

namespace {

// The ledger categories zsctl memory shows, the model states first.
constexpr const char* kCategories[] = {"param_master", "param_half",    "grad",
                                       "optim_m",      "optim_v",       "activation",
                                       "buffer",       "fragmentation", "replica",
                                       "param_cache"};
constexpr int kModelStateCategories = 5;

uint64_t CategoryBytes(const v1::JobMemory& job, absl::string_view category) {
  uint64_t bytes = 0;
  for (const v1::CategoryBytes& c : job.categories()) {
    if (c.category() == category) bytes = c.bytes();
  }
  return bytes;
}

uint64_t ModelStateBytes(const v1::JobMemory& job) {
  uint64_t bytes = 0;
  for (int i = 0; i < kModelStateCategories; ++i) bytes += CategoryBytes(job, kCategories[i]);
  return bytes;
}

absl::StatusOr<v1::MemoryReportResponse> GetMemoryReport(const std::string& address,
                                                         const AdminOptions& options) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(options.timeout_ms));
  v1::MemoryReportRequest req;
  req.set_job_id(options.job);
  v1::MemoryReportResponse resp;
  grpc::Status s = AdminStub(address, options.security)->MemoryReport(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, address);
  return resp;
}

}  // namespace

absl::StatusOr<std::string> RunMemory(const AdminOptions& options) {
  std::string out;
  for (const std::string& address : DaemonList(options.daemons)) {
    absl::StatusOr<v1::MemoryReportResponse> resp = GetMemoryReport(address, options);
    if (!resp.ok()) return resp.status();
    absl::StrAppendFormat(
        &out, "daemon %s  total %s  limit %s\n", address, FormatBytes(resp->total_bytes()),
        resp->memory_limit_bytes() ? FormatBytes(resp->memory_limit_bytes()) : std::string("none"));
    for (const auto& j : resp->jobs()) {
      absl::StrAppendFormat(&out, "  job %s  stage %u  Ψ %s  N_d %u  partitions owned %u\n",
                            j.job_id(), j.stage(), FormatCount(j.parameters()), j.world_size(),
                            j.owned_partitions());
      for (const char* category : kCategories) {
        const uint64_t bytes = CategoryBytes(j, category);
        absl::StrAppendFormat(&out, "    %-14s %14s  (%u B)\n", category, FormatBytes(bytes),
                              bytes);
      }
      absl::StrAppendFormat(&out, "    %-14s %14s  paper formula for %u owned partition(s): %s\n",
                            "model states", FormatBytes(ModelStateBytes(j)), j.owned_partitions(),
                            FormatBytes(j.formula_bytes()));
      if (j.state_disk_bytes() > 0) {
        absl::StrAppendFormat(&out, "    %-14s %14s  (%u B) the state file, not in the RAM above\n",
                              "on --state_dir", FormatBytes(j.state_disk_bytes()),
                              j.state_disk_bytes());
      }
    }
  }
  return out;
}

absl::Status RunMemoryJson(const AdminOptions& options, std::string* document) {
  return WriteDaemons<v1::MemoryReportResponse>(
      options, [&](const std::string& address) { return GetMemoryReport(address, options); },
      [](const v1::MemoryReportResponse& resp, Json* daemon) {
        (*daemon)["total_bytes"] = resp.total_bytes();
        (*daemon)["memory_limit_bytes"] = resp.memory_limit_bytes();
        Json& jobs = (*daemon)["jobs"] = Json::array();
        for (const v1::JobMemory& j : resp.jobs()) {
          Json job;
          job["job_id"] = j.job_id();
          job["stage"] = j.stage();
          job["parameters"] = j.parameters();
          job["world_size"] = j.world_size();
          job["owned_partitions"] = j.owned_partitions();
          Json& categories = job["categories"] = Json::object();
          for (const char* category : kCategories) {
            categories[category] = CategoryBytes(j, category);
          }
          job["model_state_bytes"] = ModelStateBytes(j);
          job["formula_bytes"] = j.formula_bytes();
          job["state_disk_bytes"] = j.state_disk_bytes();
          jobs.push_back(std::move(job));
        }
      },
      document);
}

namespace {

// The checked daemon list, job and deadline every checkpoint command needs.
struct CheckpointTarget {
  std::vector<std::string> addresses;
  absl::Time deadline;
};

absl::StatusOr<CheckpointTarget> CheckCheckpointOptions(const CheckpointOptions& options) {
  CheckpointTarget t;
  t.addresses = DaemonList(options.daemons);
  if (t.addresses.empty()) {
    return absl::InvalidArgumentError(
        "--daemons is required: the job's daemons in the job's order, e.g. "
        "--daemons=node0:7070,node1:7070");
  }
  for (const std::string& a : t.addresses) {
    if (absl::Status s = ValidateHostPort(a, "--daemons"); !s.ok()) return s;
  }
  if (options.job.empty()) return absl::InvalidArgumentError("--job is required");
  if (!IsValidJobId(options.job)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--job: must be ", kJobIdRule, ", got \"", options.job, "\""));
  }
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout_ms: must be positive, got ", options.timeout_ms));
  }
  t.deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  return t;
}

// ValidateCheckpointName's error as a flag error ("--name: ...").
absl::Status CheckName(const std::string& name, bool allow_latest) {
  if (name.empty()) {
    return absl::InvalidArgumentError(allow_latest
                                          ? "--name is required: a checkpoint name or \"latest\""
                                          : "--name is required");
  }
  absl::Status s = ValidateCheckpointName(name, allow_latest);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
}

std::string Seconds(double s) {
  return s < 1 ? absl::StrFormat("%.3g ms", s * 1e3) : absl::StrFormat("%.3f s", s);
}

std::string Bytes(uint64_t b) {
  return absl::StrFormat("%s (%u B)", FormatBytes(static_cast<double>(b)), b);
}

absl::StatusOr<std::string> Save(const CheckpointOptions& options, const CheckpointTarget& t) {
  if (absl::Status s = CheckName(options.name, false); !s.ok()) return s;
  DaemonControl daemon0(t.addresses[0], MakeDaemonChannel(t.addresses[0], options.security));
  absl::StatusOr<v1::StepState> state = daemon0.GetStepState(options.job, t.deadline);
  if (!state.ok()) return state.status();
  const uint64_t step = state->committed_step();
  std::unique_ptr<CheckpointDriver> driver =
      CheckpointDriver::Connect(options.job, t.addresses, options.security);
  absl::StatusOr<CheckpointStarted> started = driver->Start(options.name, step, t.deadline);
  if (!started.ok()) {
    // A running job may commit between the read of its step and the save.
    absl::StatusOr<v1::StepState> now = daemon0.GetStepState(options.job, t.deadline);
    if (absl::IsFailedPrecondition(started.status()) && now.ok() &&
        now->committed_step() != step) {
      return absl::Status(
          started.status().code(),
          absl::StrCat(started.status().message(), " (the job committed step ",
                       now->committed_step(), " while zsctl saved step ", step,
                       "; a training job is saved between its steps by its leader: Client::SaveCheckpoint, "
                       "ShardedOptimizer.save_checkpoint)"));
    }
    return started.status();
  }
  absl::StatusOr<CheckpointCompleted> done = driver->Finish(options.name, t.deadline);
  if (!done.ok()) return done.status();
  return absl::StrFormat(
      "checkpoint %s of job %s: step %u, %s on %d daemon(s)\n"
      "  snapshot %s (the training stall), write %s\n",
      done->name, options.job, done->step, Bytes(done->bytes), t.addresses.size(),
      Seconds(started->snapshot_seconds), Seconds(done->write_seconds));
}

absl::StatusOr<std::string> Load(const CheckpointOptions& options, const CheckpointTarget& t) {
  if (absl::Status s = CheckName(options.name, true); !s.ok()) return s;
  absl::StatusOr<v1::LoadCheckpointResponse> loaded =
      CheckpointDriver::Connect(options.job, t.addresses, options.security)
          ->Load(options.name, t.deadline);
  if (!loaded.ok()) return loaded.status();
  return absl::StrFormat(
      "job %s loaded checkpoint %s on %d daemon(s): committed step %u, daemon 0 read %s in %s\n",
      options.job, loaded->name(), t.addresses.size(), loaded->step(),
      Bytes(loaded->bytes_read()), Seconds(loaded->seconds()));
}

std::string FormatUnixMs(int64_t ms) {
  if (ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(ms), absl::UTCTimeZone());
}

absl::StatusOr<std::string> List(const CheckpointOptions& options, const CheckpointTarget& t) {
  absl::StatusOr<std::vector<v1::CheckpointInfo>> all =
      CheckpointDriver::Connect(options.job, t.addresses, options.security)->List(t.deadline);
  if (!all.ok()) return all.status();
  if (all->empty()) {
    return absl::StrFormat("job %s: no complete checkpoint on its %d daemon(s)\n", options.job,
                           t.addresses.size());
  }
  size_t width = 4;
  for (const v1::CheckpointInfo& c : *all) width = std::max(width, c.name().size());
  std::string out = absl::StrCat(PadRight("name", width + 2), PadLeft("step", 10),
                                 PadLeft("N_d", 7), PadLeft("daemons", 9), PadLeft("stage", 7),
                                 PadLeft("size", 11), "  completed\n");
  for (const v1::CheckpointInfo& c : *all) {
    absl::StrAppend(&out, PadRight(c.name(), width + 2), PadLeft(absl::StrCat(c.step()), 10),
                    PadLeft(absl::StrCat(c.world_size()), 7),
                    PadLeft(absl::StrCat(c.daemon_count()), 9),
                    PadLeft(absl::StrCat(c.stage()), 7),
                    PadLeft(FormatBytes(static_cast<double>(c.bytes())), 11), "  ",
                    FormatUnixMs(c.completed_unix_ms()), "\n");
  }
  return out;
}

absl::StatusOr<std::string> Verify(const CheckpointOptions& options, const CheckpointTarget& t) {
  const std::string name = options.name.empty() ? kLatestCheckpoint : options.name;
  if (absl::Status s = CheckName(name, true); !s.ok()) return s;
  absl::StatusOr<v1::VerifyCheckpointResponse> r =
      CheckpointDriver::Connect(options.job, t.addresses, options.security)
          ->Verify(name, t.deadline);
  if (!r.ok()) return r.status();
  return absl::StrFormat(
      "checkpoint %s (step %d) of job %s: all %d parts match their CRC-32C (%s read)\n",
      r->name(), r->step(), options.job, r->parts(), Bytes(r->bytes_read()));
}

}  // namespace

absl::StatusOr<std::string> RunCheckpoint(absl::string_view action,
                                          const CheckpointOptions& options) {
  static const char kActions[] = "save, load, list or verify";
  if (action != "save" && action != "load" && action != "list" && action != "verify") {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: unknown action \"", action, "\" (", kActions, ")"));
  }
  absl::StatusOr<CheckpointTarget> target = CheckCheckpointOptions(options);
  if (!target.ok()) return target.status();
  if (action == "save") return Save(options, *target);
  if (action == "load") return Load(options, *target);
  if (action == "list") return List(options, *target);
  return Verify(options, *target);
}

}  // namespace zeroshard::tools
