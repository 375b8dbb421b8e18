#pragma once

// Summaries the benchmarks report: the hosts are shared and noisy, so each
// figure is the median of several repetitions.

#include <vector>

namespace zeroshard::bench {

// The median of `values` (the mean of the middle two for an even count);
// NaN for none.
double Median(std::vector<double> values);

// Tells the compiler that the memory at `written` is read afterwards, so
// that a baseline's copies into a buffer nothing reads are not dropped.
inline void KeepWrites(const void* written) { asm volatile("" : : "r"(written) : "memory"); }

}  // namespace zeroshard::bench
