#pragma once

// Summaries the benchmarks report: the hosts are shared and noisy, so each
// figure is the median of several repetitions.

#include <string>
#include <vector>

namespace zeroshard::bench {

// The median of `values` (the mean of the middle two for an even count);
// NaN for none.
double Median(std::vector<double> values);

// Which threshold glibc's memcpy uses for non-temporal stores in this
// process: the one GLIBC_TUNABLES sets (glibc.cpu.x86_non_temporal_threshold),
// or glibc's default, derived from the L3 size the CPU reports (named). One
// line, for a benchmark's header: copies of tens of MiB run at about twice
// the speed with non-temporal stores on a machine whose default is above
// them (zsrun --nt_copy_threshold).
std::string DescribeCopyThreshold();

// Tells the compiler that the memory at `written` is read afterwards, so
// that a baseline's copies into a buffer nothing reads are not dropped.
inline void KeepWrites(const void* written) { asm volatile("" : : "r"(written) : "memory"); }

}  // namespace zeroshard::bench
