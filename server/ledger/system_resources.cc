#include "server/ledger/system_resources.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

// cgroup v1 writes a page-rounded LONG_MAX for "no limit"; anything this
// large is no limit either way.
constexpr uint64_t kV1Unlimited = uint64_t{1} << 62;

// The whole file (they are small: /proc and cgroup files); false when it
// cannot be opened.
bool ReadSmallFile(const std::string& path, std::string* out) {
  std::FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return false;
  out->clear();
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 && out->size() < (1 << 20)) {
    out->append(buf, n);
  }
  std::fclose(f);
  return true;
}

// A limit file's value: a byte count, or 0 for none ("max", missing or
// unreadable).
uint64_t ReadLimitFile(const std::string& path) {
  std::string text;
  if (!ReadSmallFile(path, &text)) return 0;
  const absl::string_view value = absl::StripAsciiWhitespace(text);
  uint64_t bytes = 0;
  if (value == "max" || !absl::SimpleAtoi(value, &bytes)) return 0;
  return bytes;
}

// Calls `visit` with `dir` + `path` and each of its ancestors up to `dir`
// itself; nothing for a path that climbs out of the mount.
void ForEachLevel(const std::string& dir, absl::string_view path,
                  absl::FunctionRef<void(const std::string& level)> visit) {
  std::vector<absl::string_view> parts;
  for (absl::string_view p : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    // A path that climbs out of the mount is not a cgroup of it.
    if (p == "..") return;
    parts.push_back(p);
  }
  for (size_t depth = 0; depth <= parts.size(); ++depth) {
    std::string level = dir;
    for (size_t i = 0; i < depth; ++i) absl::StrAppend(&level, "/", parts[i]);
    visit(level);
  }
}

// For each cgroup of /proc/<pid>/cgroup text: `v2(path)` for the unified
// hierarchy's ("0::/path"), `v1(controllers, path)` for each v1 line
// ("N:cpu,cpuacct:/path").
void ForEachCgroup(
    absl::string_view proc_self_cgroup_text, absl::FunctionRef<void(absl::string_view path)> v2,
    absl::FunctionRef<void(absl::string_view controllers, absl::string_view path)> v1) {
  // Lines are "hierarchy-id:controller,list:/path"; the path may hold ':'.
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup_text, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3 || fields[2].empty() || fields[2][0] != '/') continue;
    if (fields[0] == "0" && fields[1].empty()) {
      v2(fields[2]);
    } else {
      v1(fields[1], fields[2]);
    }
  }
}

// The smaller of two limits where 0 means none.
template <typename T>
T MinLimit(T a, T b) {
  if (a == 0) return b;
  if (b == 0) return a;
  return std::min(a, b);
}

}  // namespace

absl::StatusOr<uint64_t> ParseMemoryLimit(absl::string_view text, absl::string_view flag) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag,
        ": must be \"auto\", 0 (no limit) or a number of bytes with an optional suffix K, "
        "M, G or T (also KiB, MiB, GiB, TiB; powers of 1024), got \"",
        text.substr(0, 64), "\"", why));
  };
  if (text == "auto") {
    const uint64_t limit = AutoMemoryLimit();
    if (limit == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag,
          ": \"auto\" cannot tell this machine's memory (sysconf and /proc/meminfo say "
          "nothing); give a number of bytes"));
    }
    return limit;
  }
  size_t digits = 0;
  while (digits < text.size() && absl::ascii_isdigit(static_cast<unsigned char>(text[digits]))) {
    ++digits;
  }
  if (digits == 0) return invalid("");
  const absl::string_view suffix = text.substr(digits);
  int shift = 0;
  if (suffix.empty()) {
    shift = 0;
  } else if (suffix == "K" || suffix == "KiB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MiB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GiB") {
    shift = 30;
  } else if (suffix == "T" || suffix == "TiB") {
    shift = 40;
  } else {
    return invalid("");
  }
  uint64_t count = 0;
  if (!absl::SimpleAtoi(text.substr(0, digits), &count)) {
    return invalid(" (more than 2^64 - 1 bytes)");
  }
  if (shift > 0 && count > (~uint64_t{0} >> shift)) {
    return invalid(" (more than 2^64 - 1 bytes)");
  }
  return count << shift;
}

uint64_t MeminfoTotalBytes(absl::string_view meminfo_text) {
  for (absl::string_view line : absl::StrSplit(meminfo_text, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemTotal:")) continue;
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&line, "kB")) return 0;
    uint64_t kib = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib) || kib > (~uint64_t{0} >> 10)) {
      return 0;
    }
    return kib << 10;
  }
  return 0;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0 &&
      static_cast<uint64_t>(pages) <= ~uint64_t{0} / static_cast<uint64_t>(page_size)) {
    return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  }
  std::string meminfo;
  if (!ReadSmallFile("/proc/meminfo", &meminfo)) return 0;
  return MeminfoTotalBytes(meminfo);
}

uint64_t CgroupMemoryLimit(const std::string& proc_self_cgroup_text,
                           const std::string& cgroup_root) {
  uint64_t smallest = 0;
  auto take = [&](const std::string& file, uint64_t ignore_from) {
    const uint64_t limit = ReadLimitFile(file);
    if (limit < ignore_from) smallest = MinLimit(smallest, limit);
  };
  ForEachCgroup(
      proc_self_cgroup_text,
      [&](absl::string_view path) {
        ForEachLevel(cgroup_root, path, [&](const std::string& level) {
          take(absl::StrCat(level, "/memory.max"), ~uint64_t{0});
        });
      },
      [&](absl::string_view controllers, absl::string_view path) {
        for (absl::string_view controller : absl::StrSplit(controllers, ',')) {
          if (controller != "memory") continue;
          ForEachLevel(absl::StrCat(cgroup_root, "/memory"), path, [&](const std::string& level) {
            take(absl::StrCat(level, "/memory.limit_in_bytes"), kV1Unlimited);
          });
        }
      });
  return smallest;
}

double CgroupCpuLimit(const std::string& proc_self_cgroup_text, const std::string& cgroup_root) {
  double smallest = 0;
  // A quota over a period, in microseconds; 0 for none.
  auto cores = [](absl::string_view quota, absl::string_view period) -> double {
    int64_t q = 0, p = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(quota), &q) ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(period), &p) || q <= 0 || p <= 0) {
      return 0;
    }
    return static_cast<double>(q) / static_cast<double>(p);
  };
  ForEachCgroup(
      proc_self_cgroup_text,
      [&](absl::string_view path) {
        ForEachLevel(cgroup_root, path, [&](const std::string& level) {
          // "max 100000" (none) or "200000 100000" (two CPUs).
          std::string text;
          if (!ReadSmallFile(absl::StrCat(level, "/cpu.max"), &text)) return;
          std::vector<absl::string_view> f =
              absl::StrSplit(absl::StripAsciiWhitespace(text), ' ', absl::SkipEmpty());
          if (f.size() == 2) smallest = MinLimit(smallest, cores(f[0], f[1]));
        });
      },
      [&](absl::string_view controllers, absl::string_view path) {
        bool cpu = false;
        for (absl::string_view c : absl::StrSplit(controllers, ',')) cpu = cpu || c == "cpu";
        if (!cpu) return;
        // Mounted under the controller list's name ("cpu,cpuacct").
        ForEachLevel(absl::StrCat(cgroup_root, "/", controllers), path,
                     [&](const std::string& level) {
                       std::string quota, period;
                       if (ReadSmallFile(absl::StrCat(level, "/cpu.cfs_quota_us"), &quota) &&
                           ReadSmallFile(absl::StrCat(level, "/cpu.cfs_period_us"), &period)) {
                         smallest = MinLimit(smallest, cores(quota, period));
                       }
                     });
      });
  return smallest;
}

int AffinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
  return CPU_COUNT(&set);
}

std::vector<int> AffinityCpuList() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", cpus[i]);
    if (j > i) absl::StrAppend(&out, "-", cpus[j]);
    i = j + 1;
  }
  return out;
}

namespace {

absl::Status CpuListError(absl::string_view flag, absl::string_view why,
                          const std::vector<int>& allowed) {
  return absl::InvalidArgumentError(absl::StrCat(
      flag, ": ", why, "; give a CPU list such as 0-3,8 of the CPUs this process may run on (",
      allowed.empty() ? "unknown" : FormatCpuList(allowed), "), or all"));
}

}  // namespace

absl::Status CheckCpuList(const std::vector<int>& cpus, const std::vector<int>& allowed,
                          absl::string_view flag) {
  if (cpus.size() > kMaxListedCpus) {
    return CpuListError(flag, absl::StrCat("more than ", kMaxListedCpus, " CPUs"), allowed);
  }
  for (int c : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) {
      return CpuListError(flag, absl::StrCat("CPU ", c, " is not one this process may run on"),
                          allowed);
    }
  }
  std::vector<int> sorted = cpus;
  std::sort(sorted.begin(), sorted.end());
  if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    return CpuListError(flag, absl::StrCat("CPU ", *twice, " is listed twice"), allowed);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text,
                                              const std::vector<int>& allowed,
                                              absl::string_view flag) {
  auto refuse = [&](absl::string_view why) { return CpuListError(flag, why, allowed); };
  text = absl::StripAsciiWhitespace(text);
  if (text == "all") {
    if (allowed.empty()) return refuse("this process's CPUs cannot be told");
    if (allowed.size() > kMaxListedCpus) {
      return std::vector<int>(allowed.begin(), allowed.begin() + kMaxListedCpus);
    }
    return allowed;
  }
  if (text.empty()) return refuse("empty");
  std::vector<int> out;
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> range =
        absl::StrSplit(entry, absl::MaxSplits('-', 1));
    const bool is_range = entry.find('-') != absl::string_view::npos;
    int first = 0, last = 0;
    if (!absl::SimpleAtoi(range.first, &first) || first < 0 ||
        (is_range && (!absl::SimpleAtoi(range.second, &last) || last < first)) ||
        range.first.empty() || (is_range && range.second.empty())) {
      return refuse(absl::StrCat("\"", entry, "\" is not a CPU number or an ascending range"));
    }
    if (!is_range) last = first;
    // Bounded: a range longer than the most CPUs a list may name is refused.
    for (int c = first; c <= last && out.size() <= kMaxListedCpus; ++c) out.push_back(c);
  }
  RETURN_IF_ERROR(CheckCpuList(out, allowed, flag));
  std::sort(out.begin(), out.end());
  return out;
}

int UsableCpus() {
  int cpus = AffinityCpus();
  if (cpus <= 0) cpus = static_cast<int>(std::max<long>(::sysconf(_SC_NPROCESSORS_ONLN), 1));
  std::string cgroup;
  if (ReadSmallFile("/proc/self/cgroup", &cgroup)) {
    const double limit = CgroupCpuLimit(cgroup, "/sys/fs/cgroup");
    if (limit > 0) cpus = std::min(cpus, std::max(1, static_cast<int>(std::ceil(limit))));
  }
  return std::max(cpus, 1);
}

uint64_t AutoMemoryLimit() {
  uint64_t bytes = PhysicalMemoryBytes();
  std::string cgroup;
  if (ReadSmallFile("/proc/self/cgroup", &cgroup)) {
    const uint64_t limit = CgroupMemoryLimit(cgroup, "/sys/fs/cgroup");
    if (limit != 0) bytes = bytes == 0 ? limit : std::min(bytes, limit);
  }
  return bytes / 10 * 9;
}

}  // namespace zeroshard
