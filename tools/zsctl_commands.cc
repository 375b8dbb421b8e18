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
#include "common/estimator.h"
#include "common/format.h"
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

std::unique_ptr<v1::Admin::Stub> AdminStub(const std::string& address) {
  return v1::Admin::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& address) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("daemon ", address, ": ", s.error_message()));
}

}  // namespace

absl::StatusOr<std::string> RunStatus(const AdminOptions& options) {
  std::string out;
  for (const std::string& address : DaemonList(options.daemons)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options.timeout_ms));
    v1::StatusResponse resp;
    grpc::Status s = AdminStub(address)->Status(&ctx, v1::StatusRequest(), &resp);
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
    }
  }
  return out;
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
    grpc::Status s = AdminStub(address)->MemoryReport(&ctx, req, &resp);
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

}  // namespace zeroshard::tools
