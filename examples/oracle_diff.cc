#include "examples/oracle_diff.h"

#include <algorithm>
#include <cmath>
#include <thread>

namespace zeroshard::examples {

std::vector<double> MeanLosses(const std::vector<TrainResult>& ranks) {
  std::vector<double> mean;
  if (ranks.empty()) return mean;
  for (size_t s = 0; s < ranks[0].losses.size(); ++s) {
    double sum = 0;
    for (const TrainResult& r : ranks) sum += r.losses[s];
    mean.push_back(sum / ranks.size());
  }
  return mean;
}

OracleDiff CompareWithReference(const std::vector<float>& params,
                                const std::vector<double>& losses,
                                const TrainResult& reference) {
  OracleDiff d;
  double diff_sq = 0, ref_sq = 0, ref_max = 0, diff_max = 0;
  for (size_t i = 0; i < reference.params.size(); ++i) {
    const double diff = double(params[i]) - reference.params[i];
    diff_sq += diff * diff;
    ref_sq += double(reference.params[i]) * reference.params[i];
    diff_max = std::max(diff_max, std::fabs(diff));
    ref_max = std::max(ref_max, std::fabs(double(reference.params[i])));
  }
  d.params_rel = std::sqrt(diff_sq / ref_sq);
  d.params_max = diff_max / ref_max;
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    d.loss_max = std::max(
        d.loss_max, std::fabs(losses[s] - reference.losses[s]) / reference.losses[s]);
  }
  return d;
}

std::vector<absl::StatusOr<TrainResult>> TrainRanksInThreads(TrainOptions o, uint32_t world,
                                                             const StartCallback& on_start) {
  o.world_size = world;
  std::vector<absl::StatusOr<TrainResult>> results(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      TrainOptions mine = o;
      mine.rank = r;
      results[r] = TrainRank(mine, nullptr, nullptr, r == 0 ? on_start : nullptr);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace zeroshard::examples
