#include "tools/zsctl_commands.h"

#include <cctype>
#include <cmath>
#include <memory>
#include <vector>

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

absl::StatusOr<std::string> RunEstimate(const EstimateOptions& options) {
  if (options.params.empty()) {
    return absl::InvalidArgumentError("--params is required, e.g. --params 7.5e9");
  }
  absl::StatusOr<double> psi = ParseCount(options.params);
  if (!psi.ok()) return psi.status();
  double device = 0;
  if (!options.device_memory.empty()) {
    absl::StatusOr<double> d = ParseBytes(options.device_memory);
    if (!d.ok()) return d.status();
    device = *d;
  }
  static const char* const kNames[] = {"0  baseline DP", "1  P_os", "2  P_os+g", "3  P_os+g+p"};
  static const char* const kFormulas[] = {"(4+K)Ψ", "4Ψ+KΨ/N_d", "2Ψ+(2+K)Ψ/N_d", "(4+K)Ψ/N_d"};
  std::string out = absl::StrFormat(
      "Model states per rank for Ψ = %s parameters, N_d = %u, K = %s\n"
      "(ZeRO paper, mixed-precision training; decimal units, 3 significant figures)\n\n",
      FormatCount(*psi), options.world_size, FormatSig3(options.optimizer_k));
  absl::StrAppend(&out, PadRight("stage", 16), PadRight("formula", 15), PadLeft("params", 10),
                  PadLeft("grads", 10), PadLeft("optimizer", 10), PadLeft("total", 10),
                  PadLeft("comm/step", 13));
  if (device > 0) absl::StrAppend(&out, PadLeft("max Ψ", 9));
  out += "\n";
  for (int stage = 0; stage <= 3; ++stage) {
    auto e = EstimateModelStates(stage, *psi, options.world_size, options.optimizer_k);
    if (!e.ok()) return e.status();
    absl::StrAppend(&out, PadRight(kNames[stage], 16), PadRight(kFormulas[stage], 15),
                    PadLeft(FormatBytes(e->param_bytes), 10),
                    PadLeft(FormatBytes(e->grad_bytes), 10),
                    PadLeft(FormatBytes(e->optimizer_bytes), 10),
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
  return out;
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

// For zsctl status --job: each rank as the daemon sees it, and what its open
// step waits for.
absl::StatusOr<std::string> RankLines(const std::string& address, const AdminOptions& options) {
  DaemonControl daemon(address, MakeDaemonChannel(address, options.security));
  absl::StatusOr<v1::StepState> state =
      daemon.GetStepState(options.job, absl::Now() + absl::Milliseconds(options.timeout_ms));
  if (!state.ok()) return state.status();
  std::string out;
  for (const v1::RankState& r : state->ranks()) {
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
                        state->committed_step() + 1, state->prepared() ? "prepared" : "pushing",
                        state->complete_elements(), state->owned_elements());
  if (const std::string waits = DescribeWaits(address, *state); !waits.empty()) {
    absl::StrAppend(&out, "    ", waits, "\n");
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> RunStatus(const AdminOptions& options) {
  std::string out;
  for (const std::string& address : DaemonList(options.daemons)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options.timeout_ms));
    v1::StatusResponse resp;
    grpc::Status s = AdminStub(address, options.security)->Status(&ctx, v1::StatusRequest(), &resp);
    if (!s.ok()) return FromGrpc(s, address);
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
      if (j.job_id() == options.job) {
        absl::StatusOr<std::string> ranks = RankLines(address, options);
        if (!ranks.ok()) return ranks.status();
        absl::StrAppend(&out, *ranks);
      }
    }
  }
  return out;
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

absl::StatusOr<std::string> RunToken() {
  absl::StatusOr<std::string> token = GenerateToken();
  if (!token.ok()) return token.status();
  return absl::StrCat(*token, "\n");
}

absl::StatusOr<std::string> RunMemory(const AdminOptions& options) {
  static const char* const kCategories[] = {"param_master", "param_half", "grad",
                                            "optim_m",      "optim_v",    "activation",
                                            "buffer",       "fragmentation"};
  std::string out;
  for (const std::string& address : DaemonList(options.daemons)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options.timeout_ms));
    v1::MemoryReportRequest req;
    req.set_job_id(options.job);
    v1::MemoryReportResponse resp;
    grpc::Status s = AdminStub(address, options.security)->MemoryReport(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s, address);
    absl::StrAppendFormat(&out, "daemon %s  total %s  limit %s\n", address,
                          FormatBytes(resp.total_bytes()),
                          resp.memory_limit_bytes() ? FormatBytes(resp.memory_limit_bytes())
                                                    : std::string("none"));
    for (const auto& j : resp.jobs()) {
      absl::StrAppendFormat(&out, "  job %s  stage %u  Ψ %s  N_d %u  partitions owned %u\n",
                            j.job_id(), j.stage(), FormatCount(j.parameters()), j.world_size(),
                            j.owned_partitions());
      uint64_t model_states = 0;
      for (const char* category : kCategories) {
        uint64_t bytes = 0;
        for (const auto& c : j.categories()) {
          if (c.category() == category) bytes = c.bytes();
        }
        const std::string name = category;
        if (name != "activation" && name != "buffer" && name != "fragmentation") {
          model_states += bytes;
        }
        absl::StrAppendFormat(&out, "    %-14s %14s  (%u B)\n", category, FormatBytes(bytes),
                              bytes);
      }
      absl::StrAppendFormat(&out,
                            "    %-14s %14s  paper formula for %u owned partition(s): %s\n",
                            "model states", FormatBytes(model_states), j.owned_partitions(),
                            FormatBytes(j.formula_bytes()));
    }
  }
  return out;
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
