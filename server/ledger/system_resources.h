#pragma once

// What this machine lets a daemon use: how much memory it may book (the
// --memory_limit flag, and the memory this machine or this process's cgroup
// allows, for --memory_limit=auto), and how many CPUs its optimizer may run
// on (--optimizer_threads' default).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// "auto" (AutoMemoryLimit()), "0" (no limit), or a decimal byte count with
// an optional suffix K, M, G or T (also KiB, MiB, GiB, TiB), all powers of
// 1024. InvalidArgument naming `flag` and what it accepts for anything else,
// for a count past 2^64 - 1, and for "auto" on a machine whose memory cannot
// be told.
absl::StatusOr<uint64_t> ParseMemoryLimit(absl::string_view text, absl::string_view flag);

// 90% of the smaller of this machine's physical memory and this process's
// cgroup memory limit (when it has one); 0 when neither can be read.
uint64_t AutoMemoryLimit();

// Physical memory in bytes (sysconf, else /proc/meminfo); 0 when unknown.
uint64_t PhysicalMemoryBytes();

// MemTotal of /proc/meminfo text, in bytes; 0 when absent or malformed.
uint64_t MeminfoTotalBytes(absl::string_view meminfo_text);

// The memory limit of the cgroup a process belongs to, given the text of its
// /proc/<pid>/cgroup and where the cgroup filesystems are mounted (normally
// /sys/fs/cgroup). cgroup v2 ("0::/path"): the smallest memory.max of the
// process's cgroup and its ancestors under `cgroup_root` ("max" is none).
// cgroup v1 (a "memory" controller line): the smallest
// memory.limit_in_bytes under `cgroup_root`/memory along the same path
// (values of 2^62 and more mean none). Levels whose files are missing are
// skipped: inside a container the cgroup path names the host's hierarchy
// while the mount shows the container's own cgroup at its root. 0 when no
// limit is found.
uint64_t CgroupMemoryLimit(const std::string& proc_self_cgroup_text,
                           const std::string& cgroup_root);

// The CPU limit of the cgroup a process belongs to, in CPUs (a quota over
// its period: 1.5 is 150 ms per 100 ms), given the text of its
// /proc/<pid>/cgroup and the cgroup mount, like CgroupMemoryLimit: cgroup v2
// cpu.max ("max" is none), cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us
// under `cgroup_root`/<controller list> (-1 is none); the smallest along the
// path. 0 when no limit is found.
double CgroupCpuLimit(const std::string& proc_self_cgroup_text, const std::string& cgroup_root);

// CPUs this process may run on (sched_getaffinity); 0 when unknown.
int AffinityCpus();

// The CPU numbers of this process's affinity mask, ascending; empty when
// unknown.
std::vector<int> AffinityCpuList();

// A Linux CPU list ("0-3,8,10-11", the format of /sys and taskset -c) as
// CPU numbers, ascending, or "all": every CPU of `allowed`. Each listed CPU
// must be in `allowed` (the affinity mask: AffinityCpuList()), and a range
// ascending; at most kMaxListedCpus CPUs. InvalidArgument naming `flag`, the
// offending entry and the CPUs allowed otherwise (duplicates included).
inline constexpr size_t kMaxListedCpus = 256;
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text,
                                              const std::vector<int>& allowed,
                                              absl::string_view flag);
// InvalidArgument, as ParseCpuList's, unless `cpus` are at most
// kMaxListedCpus distinct CPUs of `allowed` (ascending).
absl::Status CheckCpuList(const std::vector<int>& cpus, const std::vector<int>& allowed,
                          absl::string_view flag);
// CPU numbers as a Linux CPU list, ranges merged ("0-3,8").
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPUs this process may use: its affinity mask's count, lowered to its
// cgroup's CPU limit rounded up; at least 1.
int UsableCpus();

}  // namespace zeroshard
