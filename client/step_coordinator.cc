#include "client/step_coordinator.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

constexpr absl::Duration kMinBackoff = absl::Milliseconds(1);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(50);
// A follower's long poll for the leader's commit, and what it leaves of the
// RPC's deadline for the answer to come back.
constexpr absl::Duration kFollowerWait = absl::Seconds(1);
constexpr absl::Duration kFollowerWaitMargin = absl::Milliseconds(200);

// The global gradient norm from every daemon's partial sum of squares,
// summed in daemon order, so that every rank computes the same bits.
float GlobalNorm(const std::vector<v1::PrepareStepResponse>& prepared) {
  double sum_sq = 0;
  for (const auto& p : prepared) sum_sq += p.grad_sq_sum();
  return static_cast<float>(std::sqrt(sum_sq));
}

// torch.nn.utils.clip_grad_norm_'s coefficient.
float ClipCoef(float norm, float max_grad_norm) {
  return std::min(1.0f, max_grad_norm / (norm + 1e-6f));
}

}  // namespace

absl::Status PollWithBackoff(absl::Time deadline, absl::string_view what,
                             absl::FunctionRef<absl::Status(std::string* waiting)> poll) {
  absl::Duration backoff = kMinBackoff;
  std::string waiting;
  for (;;) {
    waiting.clear();
    RETURN_IF_ERROR(poll(&waiting));
    if (waiting.empty()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) return absl::DeadlineExceededError(absl::StrCat(what, ": ", waiting));
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

StepCoordinator::StepCoordinator(Options options, std::vector<DaemonControl*> daemons,
                                 Executor* io)
    : options_(std::move(options)), daemons_(std::move(daemons)), io_(io) {}

absl::StatusOr<StepResult> StepCoordinator::Step(uint64_t step, float lr,
                                                 std::vector<float> group_lrs) {
  if (HasPendingCommit(step)) return Commit(*pending_);
  return options_.id.rank == 0 ? LeaderStep(step, lr, std::move(group_lrs)) : FollowerStep(step);
}

absl::Status StepCoordinator::AwaitAllRanksJoined() {
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  std::vector<bool> ready(daemons_.size(), false);
  return PollWithBackoff(
      deadline,
      absl::StrCat("RegisterModel: not every rank joined job ", options_.id.job_id,
                   " within step_timeout (", absl::FormatDuration(options_.step_timeout), ")"),
      [&](std::string* waiting) -> absl::Status {
        for (size_t d = 0; d < daemons_.size(); ++d) {
          if (ready[d]) continue;
          ASSIGN_OR_RETURN(
              v1::StepState s,
              daemons_[d]->GetStepState(options_.id.job_id, RpcDeadline(deadline), 0,
                                        absl::ZeroDuration(), DaemonControl::Detail::kBrief));
          ready[d] = s.ranks_joined() >= options_.world_size;
          if (!ready[d] && waiting->empty()) {
            *waiting = absl::StrCat("daemon ", daemons_[d]->address(), " has ", s.ranks_joined(),
                                    " of ", options_.world_size, " ranks");
          }
        }
        return absl::OkStatus();
      });
}

absl::StatusOr<uint64_t> StepCoordinator::MaxCommittedStep() {
  std::vector<uint64_t> committed(daemons_.size(), 0);
  RETURN_IF_ERROR(
      ParallelFor(*io_, static_cast<uint32_t>(daemons_.size()), [&](uint32_t d) -> absl::Status {
        ASSIGN_OR_RETURN(
            v1::StepState s,
            daemons_[d]->GetStepState(options_.id.job_id, absl::Now() + options_.rpc_timeout));
        committed[d] = s.committed_step();
        return absl::OkStatus();
      }));
  return *std::max_element(committed.begin(), committed.end());
}

absl::Status StepCoordinator::CheckOpenStep(size_t d, uint64_t step, absl::Time deadline) {
  ASSIGN_OR_RETURN(v1::StepState s,
                   daemons_[d]->GetStepState(options_.id.job_id, RpcDeadline(deadline), 0,
                                             absl::ZeroDuration(), DaemonControl::Detail::kBrief));
  if (s.committed_step() + 1 == step) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "Step ", step, ": daemon ", daemons_[d]->address(), " has committed step ",
      s.committed_step(), ", this client expected ", step - 1));
}

absl::Status StepCoordinator::WithMissing(absl::Status s) {
  if (!absl::IsDeadlineExceeded(s)) return s;
  // A short look of its own: the step's deadline has passed already.
  const absl::Time deadline = absl::Now() + std::min(options_.rpc_timeout, absl::Seconds(2));
  std::string missing;
  for (DaemonControl* d : daemons_) {
    absl::StatusOr<v1::StepState> state = d->GetStepState(options_.id.job_id, deadline);
    if (!state.ok()) continue;
    const std::string waits = DescribeWaits(d->address(), *state);
    if (!waits.empty()) absl::StrAppend(&missing, "; ", waits);
  }
  if (missing.empty()) return s;
  return absl::DeadlineExceededError(absl::StrCat(s.message(), missing));
}

absl::StatusOr<std::vector<v1::PrepareStepResponse>> StepCoordinator::PrepareAll(
    uint64_t step, absl::Time deadline) {
  const size_t n = daemons_.size();
  std::vector<std::optional<v1::PrepareStepResponse>> prepared(n);
  std::vector<bool> checked(n, false);
  absl::Status s = PollWithBackoff(
      deadline,
      absl::StrCat("Step ", step, ": not every rank's gradients arrived within step_timeout (",
                   absl::FormatDuration(options_.step_timeout), ")"),
      [&](std::string* waiting) -> absl::Status {
        for (size_t d = 0; d < n; ++d) {
          if (prepared[d].has_value()) continue;
          absl::StatusOr<v1::PrepareStepResponse> r =
              daemons_[d]->PrepareStep(options_.id, step, RpcDeadline(deadline));
          if (r.ok()) {
            prepared[d] = *std::move(r);
            continue;
          }
          if (!absl::IsFailedPrecondition(r.status())) return r.status();
          // Incomplete gradients (retry) or a daemon on another step (fail).
          if (!checked[d]) RETURN_IF_ERROR(CheckOpenStep(d, step, deadline));
          checked[d] = true;
          if (waiting->empty()) *waiting = std::string(r.status().message());
        }
        return absl::OkStatus();
      });
  RETURN_IF_ERROR(WithMissing(std::move(s)));
  std::vector<v1::PrepareStepResponse> out;
  for (auto& p : prepared) out.push_back(*std::move(p));
  return out;
}

absl::StatusOr<StepResult> StepCoordinator::LeaderStep(uint64_t step, float lr,
                                                       std::vector<float> group_lrs) {
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  ASSIGN_OR_RETURN(std::vector<v1::PrepareStepResponse> prepared, PrepareAll(step, deadline));
  bool found_inf_nan = false;
  for (const auto& p : prepared) found_inf_nan = found_inf_nan || p.found_inf_nan();
  PendingCommit commit;
  commit.step = step;
  commit.lr = group_lrs.empty() ? lr : group_lrs[0];
  commit.group_lrs = std::move(group_lrs);
  commit.grad_norm = GlobalNorm(prepared);
  commit.skip = found_inf_nan || !std::isfinite(commit.grad_norm);
  if (!commit.skip && options_.max_grad_norm > 0) {
    commit.clip_coef = ClipCoef(commit.grad_norm, options_.max_grad_norm);
  }
  pending_ = commit;
  return Commit(commit);
}

absl::StatusOr<StepResult> StepCoordinator::Commit(const PendingCommit& commit) {
  v1::CommitStepRequest request;
  request.set_job_id(options_.id.job_id);
  request.set_step(commit.step);
  request.set_clip_coef(commit.clip_coef);
  request.set_skip(commit.skip);
  request.set_lr(commit.lr);
  for (float g : commit.group_lrs) request.add_group_lrs(g);
  request.set_grad_norm(commit.grad_norm);
  request.set_rank(options_.id.rank);
  request.set_incarnation(options_.id.incarnation);
  std::vector<v1::CommitStepResponse> responses(daemons_.size());
  RETURN_IF_ERROR(
      ParallelFor(*io_, static_cast<uint32_t>(daemons_.size()), [&](uint32_t d) -> absl::Status {
        ASSIGN_OR_RETURN(responses[d],
                         daemons_[d]->CommitStep(request, absl::Now() + options_.rpc_timeout));
        if (responses[d].committed_step() != commit.step) {
          return absl::InternalError(absl::StrCat("daemon ", daemons_[d]->address(),
                                                  ": CommitStep ", commit.step, " answered step ",
                                                  responses[d].committed_step()));
        }
        return absl::OkStatus();
      }));
  StepResult result;
  result.step = commit.step;
  result.skipped = responses[0].skipped();
  result.loss_scale = responses[0].loss_scale();
  result.have_norm = true;
  result.grad_norm = commit.grad_norm;
  result.clip_coef = commit.clip_coef;
  pending_.reset();
  return result;
}

absl::StatusOr<StepResult> StepCoordinator::FollowerStep(uint64_t step) {
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  const size_t n = daemons_.size();
  std::vector<std::optional<v1::StepState>> committed(n);
  absl::Status polled = PollWithBackoff(
      deadline,
      absl::StrCat("Step ", step, ": the leader (rank 0) did not commit within step_timeout (",
                   absl::FormatDuration(options_.step_timeout), ")"),
      [&](std::string* waiting) -> absl::Status {
        for (size_t d = 0; d < n; ++d) {
          if (committed[d].has_value()) continue;
          // A long poll: the daemon answers when the leader's commit lands
          // (or after a second, to look again); a daemon that does not know
          // the wait answers at once and the backoff paces the polls.
          const absl::Time rpc_deadline = RpcDeadline(deadline);
          const absl::Duration wait =
              std::min(kFollowerWait, (rpc_deadline - absl::Now()) - kFollowerWaitMargin);
          ASSIGN_OR_RETURN(v1::StepState s,
                           daemons_[d]->GetStepState(options_.id.job_id, rpc_deadline, step, wait,
                                                     DaemonControl::Detail::kBrief));
          const uint64_t c = s.committed_step();
          if (c > step || c + 1 < step) {
            return absl::FailedPreconditionError(absl::StrCat(
                "Step ", step, ": daemon ", daemons_[d]->address(), " has committed step ", c,
                ", this client expected ", step - 1, " or ", step));
          }
          if (c == step) {
            committed[d] = std::move(s);
          } else if (waiting->empty()) {
            *waiting = absl::StrCat("daemon ", daemons_[d]->address(), " has not committed it");
          }
        }
        return absl::OkStatus();
      });
  RETURN_IF_ERROR(WithMissing(std::move(polled)));
  // Every daemon records the leader's one decision; read it from the first.
  const v1::StepState& state = *committed[0];
  StepResult result;
  result.step = step;
  result.skipped = state.last_skipped();
  result.loss_scale = state.loss_scale();
  result.have_norm = true;
  result.grad_norm = state.last_grad_norm();
  result.clip_coef = state.last_clip_coef() > 0 ? state.last_clip_coef() : 1.0f;  // 0 means 1
  return result;
}

}  // namespace zeroshard
