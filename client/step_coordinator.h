#pragma once

// The two-phase optimizer step as the ranks of a job run it, and the other
// waits on the daemons' step state:
//  - the leader (rank 0) polls PrepareStep on every daemon until every
//    rank's gradients are in, combines the partial norms (sum of grad_sq_sum
//    in daemon order, norm = float(sqrt(sum)), clip = min(1, max_grad_norm /
//    (norm + 1e-6)), skip on inf/nan) and sends the same CommitStep to every
//    daemon;
//  - a follower polls GetStepState on every daemon until each has committed
//    the step, and reads the leader's decisions (skip, loss scale, clip, norm)
//    from it;
//  - the start-up barrier polls GetStepState until every rank has joined.
// Every poll is the one PollWithBackoff below; every wait has a deadline.
//
// Threads: one caller at a time (the training loop); the per-daemon calls of
// a commit run in parallel on the executor given at construction.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/daemon_control.h"
#include "client/executor.h"

namespace zeroshard {

struct StepResult {
  uint64_t step = 0;        // the step now committed
  bool skipped = false;     // inf/nan in the gradient: no update anywhere
  float loss_scale = 1.0f;  // scale for the next step's loss
  // Global L2 norm of the averaged, unscaled gradient and the clip
  // coefficient applied, as the leader (rank 0) computed them; every rank
  // learns them (the daemons record the commit).
  bool have_norm = false;
  float grad_norm = 0.0f;  // inf or NaN when the step was skipped for overflow
  float clip_coef = 1.0f;
  // Set by Client::Step: how long it waited for this step's gradient pushes
  // to be accepted by the daemons before the step could start (what pushing
  // from backward hooks overlaps away).
  absl::Duration push_wait = absl::ZeroDuration();
};

// Calls `poll` until it leaves `*waiting` empty (done: OK), returns an error
// (that error), or `deadline` passes (DeadlineExceeded: "<what>: <waiting>").
// Between calls it sleeps 1 ms, doubling up to 50 ms, never past the
// deadline. `*waiting` is cleared before each call; `poll` sets it to what it
// still waits for.
absl::Status PollWithBackoff(absl::Time deadline, absl::string_view what,
                             absl::FunctionRef<absl::Status(std::string* waiting)> poll);

class StepCoordinator {
 public:
  struct Options {
    RankId id;  // this rank: rank 0 leads
    uint32_t world_size = 1;
    float max_grad_norm = 0.0f;  // 0: no clipping
    absl::Duration rpc_timeout = absl::Seconds(60);   // each RPC
    absl::Duration step_timeout = absl::Minutes(5);   // each wait on other ranks
  };

  // `daemons` (by daemon index) and `io` must outlive the coordinator.
  StepCoordinator(Options options, std::vector<DaemonControl*> daemons, Executor* io);

  // Whether Step(step) will only resend the commit of an earlier attempt
  // whose commit phase failed (the gradients were prepared already).
  bool HasPendingCommit(uint64_t step) const {
    return pending_.has_value() && pending_->step == step;
  }

  // Ends step `step` once this rank's gradients are in: the leader prepares
  // and commits it, a follower waits until every daemon committed it.
  // Blocks up to step_timeout. A failed commit phase is resent as it was by
  // the next call for the same step (CommitStep is idempotent). `group_lrs`:
  // each parameter group's learning rate (empty: `lr` for every group).
  absl::StatusOr<StepResult> Step(uint64_t step, float lr, std::vector<float> group_lrs = {});

  // Blocks until every daemon counts world_size joined ranks (step_timeout).
  absl::Status AwaitAllRanksJoined();

  // The largest committed step of the job over its daemons.
  absl::StatusOr<uint64_t> MaxCommittedStep();

 private:
  struct PendingCommit {
    uint64_t step = 0;
    float lr = 0;
    std::vector<float> group_lrs;
    float clip_coef = 1.0f;
    bool skip = false;
    float grad_norm = 0;
  };

  absl::Time RpcDeadline(absl::Time outer) const {
    return std::min(outer, absl::Now() + options_.rpc_timeout);
  }
  absl::StatusOr<StepResult> LeaderStep(uint64_t step, float lr, std::vector<float> group_lrs);
  // Every daemon's PrepareStep answer, polling while gradients are missing.
  absl::StatusOr<std::vector<v1::PrepareStepResponse>> PrepareAll(uint64_t step,
                                                                  absl::Time deadline);
  // FailedPrecondition unless daemon `d` has committed step - 1.
  absl::Status CheckOpenStep(size_t d, uint64_t step, absl::Time deadline);
  absl::StatusOr<StepResult> Commit(const PendingCommit& commit);
  absl::StatusOr<StepResult> FollowerStep(uint64_t step);
  // `s`, and when it is DeadlineExceeded, what the daemons still wait for
  // in the open step (StepState.missing: which rank, which range).
  absl::Status WithMissing(absl::Status s);

  const Options options_;
  const std::vector<DaemonControl*> daemons_;
  Executor* const io_;
  std::optional<PendingCommit> pending_;
};

}  // namespace zeroshard
