#pragma once

// Summaries the benchmarks report: the hosts are shared and noisy, so each
// figure is the median of several repetitions.

#include <vector>

namespace zeroshard::bench {

// The median of `values` (the mean of the middle two for an even count);
// NaN for none.
double Median(std::vector<double> values);

}  // namespace zeroshard::bench
