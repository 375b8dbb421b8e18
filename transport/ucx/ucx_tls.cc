#include "transport/ucx/ucx_tls.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace zeroshard::transport::ucx {
namespace {

constexpr char kSoftwareRma[] =
    "over which UCX emulates remote access in software and a forged key "
    "reaches any memory of this process";

constexpr char kActiveMessageRma[] =
    "over which the adapter checks keys, but UCX also serves remote access "
    "in software on every connection (its put and get messages name an "
    "address and carry no key), so a peer running a UCX of its own making "
    "reaches any memory of this process";

// UCX_TLS names (transports and UCX's aliases) that select only key-safe
// transports: shared memory on this host.
bool KeySafeTlsName(absl::string_view name) {
  static const char* const kSafe[] = {"posix", "sysv", "xpmem", "knem", "cma",
                                      "self",  "sm",   "shm",   "mm"};
  return std::any_of(std::begin(kSafe), std::end(kSafe),
                     [name](const char* safe) { return name == safe; });
}

// UCX_TLS names of RDMA transports (and aliases that select them).
bool RdmaTlsName(absl::string_view name) {
  static const char* const kRdma[] = {"rc",   "rc_v",    "rc_x", "rc_mlx5", "dc",
                                      "dc_x", "dc_mlx5", "ud",   "ud_v",    "ud_x",
                                      "ud_mlx5", "ib"};
  return std::any_of(std::begin(kRdma), std::end(kRdma),
                     [name](const char* rdma) { return name == rdma; });
}

// UCT transport names (the resources UCX selects) that are key-safe.
bool KeySafeTransport(absl::string_view tl) {
  static const char* const kSafe[] = {"posix", "sysv", "xpmem", "knem", "cma", "self"};
  return std::any_of(std::begin(kSafe), std::end(kSafe),
                     [tl](const char* safe) { return tl == safe; });
}

}  // namespace

std::vector<std::string> SelectedTransports(absl::string_view context_info) {
  std::vector<std::string> names;
  for (absl::string_view line : absl::StrSplit(context_info, '\n')) {
    line = absl::StripAsciiWhitespace(absl::StripPrefix(line, "#"));
    if (!absl::ConsumePrefix(&line, "resource")) continue;
    // The last field is "<transport>/<device>".
    const size_t space = line.find_last_of(" \t");
    const absl::string_view last =
        space == absl::string_view::npos ? line : line.substr(space + 1);
    const size_t slash = last.find('/');
    if (slash == absl::string_view::npos || slash == 0) continue;
    std::string name(last.substr(0, slash));
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(std::move(name));
    }
  }
  return names;
}

KeyEnforcement CheckRequestedTls(absl::string_view tls) {
  KeyEnforcement result;
  if (absl::StripAsciiWhitespace(tls).empty()) {
    result.reason = absl::StrCat(
        "UCX_TLS is empty: UCX picks its transports itself and may pick tcp, ",
        kSoftwareRma);
    return result;
  }
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    name = absl::StripAsciiWhitespace(name);
    if (KeySafeTlsName(name)) continue;
    if (absl::StartsWith(name, "^")) {
      result.reason = absl::StrCat(
          "UCX_TLS=\"", tls, "\" is an exclusion list: UCX picks its "
          "transports itself and may pick tcp, ", kSoftwareRma);
    } else if (name == "tcp") {
      result.reason = absl::StrCat("UCX_TLS=\"", tls, "\" names tcp, ",
                                   kSoftwareRma);
    } else if (RdmaTlsName(name)) {
      result.reason = absl::StrCat("UCX_TLS=\"", tls, "\" names \"", name,
                                   "\" (RDMA), ", kActiveMessageRma);
    } else {
      result.reason = absl::StrCat(
          "UCX_TLS=\"", tls, "\" names \"", name,
          "\", which is not known to select shared memory only: it "
          "may select tcp, ", kSoftwareRma);
    }
    return result;
  }
  result.enforced = true;
  return result;
}

KeyEnforcement DecideKeyEnforcement(absl::string_view tls,
                                    const std::vector<std::string>& selected) {
  KeyEnforcement result = CheckRequestedTls(tls);
  if (!result.enforced) return result;
  result.enforced = false;
  if (selected.empty()) {
    result.reason = absl::StrCat("UCX_TLS=\"", tls,
                                 "\": UCX reported no transport it selected");
    return result;
  }
  for (const std::string& tl : selected) {
    if (KeySafeTransport(tl)) continue;
    result.reason = absl::StrCat(
        "UCX_TLS=\"", tls, "\" selected ", absl::StrJoin(selected, ","),
        ", and ", tl, " is not known to be shared memory on this host: a "
        "forged key may reach memory it does not name");
    return result;
  }
  result.enforced = true;
  return result;
}

}  // namespace zeroshard::transport::ucx
