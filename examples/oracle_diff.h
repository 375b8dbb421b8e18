#pragma once

// How far sharded training is from the single-process torch::optim::AdamW
// reference (TrainSingleProcess), and how far it may be.

#include <vector>

#include "examples/trainer.h"

namespace zeroshard::examples {

struct OracleDiff {
  double params_rel = 0;  // ||a - b|| / ||b||
  double params_max = 0;  // max |a - b| / max |b|
  double loss_max = 0;    // max over steps of |mean rank loss - reference| / reference
};

// Tolerance: parameters within 1e-5 relative (||a - b|| / ||b||; measured
// ~1e-6), the worst element within 5e-5 of the largest parameter (measured
// ~1.3e-5 at N_d = 3), losses within 1e-5 relative (measured ~1e-7). Not 0:
// the reference sums the global batch's loss gradient in one backward pass
// while ranks sum their shares separately and the daemons add the N_d
// partial gradients, so float additions happen in a different order; the
// global norm for clipping is also summed differently.
inline constexpr double kOracleParamsRel = 1e-5;
inline constexpr double kOracleParamsMax = 5e-5;
inline constexpr double kOracleLossRel = 1e-5;

// Per step, the mean of the ranks' losses (each the mean over its equal
// share of the global batch, so their mean is the global batch's).
std::vector<double> MeanLosses(const std::vector<TrainResult>& ranks);

// `params` (flat fp32) and `losses` (per step from step 1, as MeanLosses)
// against `reference`; both must cover reference's steps and parameters.
OracleDiff CompareWithReference(const std::vector<float>& params,
                                const std::vector<double>& losses,
                                const TrainResult& reference);

// Trains ranks 0..world-1 of `o` (o.daemons set) on one thread each and
// returns their results by rank; rank 0 calls `on_start`.
std::vector<absl::StatusOr<TrainResult>> TrainRanksInThreads(TrainOptions o, uint32_t world,
                                                             const StartCallback& on_start = nullptr);

}  // namespace zeroshard::examples
