#include "client/replica_placement.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/rpc.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/checkpoint.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"

namespace zeroshard {
namespace {

// What one daemon said about the job.
struct DaemonView {
  enum Kind { kUnreachable, kNotRegistered, kHolds } kind = kUnreachable;
  std::string error;
  std::map<uint32_t, v1::ReplicaGroupState> groups;
};

DaemonView Ask(v1::Replica::Stub* stub, const std::string& address, const std::string& job_id,
               absl::Duration timeout) {
  grpc::ClientContext context;
  SetDeadline(&context, absl::Now() + timeout);
  v1::GetReplicaStateRequest request;
  request.set_job_id(job_id);
  v1::ReplicaState state;
  const grpc::Status s = stub->GetReplicaState(&context, request, &state);
  DaemonView view;
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
    view.kind = DaemonView::kNotRegistered;
  } else if (!s.ok()) {
    view.error = DaemonError(s, address, "GetReplicaState").ToString();
  } else {
    view.kind = DaemonView::kHolds;
    for (const v1::ReplicaGroupState& g : state.groups()) view.groups[g.group()] = g;
  }
  return view;
}

// What daemon `h` holds of group `g`, for a message: "is unreachable (...)",
// "holds nothing of it", "holds a backup that is not current", ...
std::string Holding(const DaemonView& view, uint32_t g, uint64_t top_epoch) {
  switch (view.kind) {
    case DaemonView::kUnreachable:
      return absl::StrCat("does not answer (", view.error, ")");
    case DaemonView::kNotRegistered:
      return "holds nothing of the job (restarted empty?)";
    case DaemonView::kHolds:
      break;
  }
  auto it = view.groups.find(g);
  if (it == view.groups.end()) return "holds nothing of the group";
  if (it->second.role() == v1::REPLICA_ROLE_BACKUP) {
    return it->second.in_sync() ? "holds a current backup" : "holds a backup that is not current";
  }
  return it->second.epoch() < top_epoch ? "holds a primary that was replaced" : "holds the primary";
}

// The newest complete checkpoint of the job any reachable daemon lists, as
// a clause for the message.
std::string NewestCheckpoint(const std::vector<std::string>& daemons,
                             const ChannelSecurity& security, const std::vector<DaemonView>& views,
                             const PlacementOptions& o) {
  const v1::CheckpointInfo* newest = nullptr;
  v1::ListCheckpointsResponse best;
  for (size_t d = 0; d < daemons.size(); ++d) {
    if (views[d].kind == DaemonView::kUnreachable) continue;
    grpc::ClientContext context;
    SetDeadline(&context, absl::Now() + o.rpc_timeout);
    v1::ListCheckpointsRequest request;
    request.set_job_id(o.job_id);
    v1::ListCheckpointsResponse list;
    if (!v1::Checkpoint::NewStub(MakeDaemonChannel(daemons[d], security, std::nullopt, o.liveness_timeout))
             ->ListCheckpoints(&context, request, &list)
             .ok() ||
        list.checkpoints().empty()) {
      continue;
    }
    const v1::CheckpointInfo& last = *list.checkpoints().rbegin();
    if (newest == nullptr || last.step() > newest->step()) {
      best = list;
      newest = &*best.checkpoints().rbegin();
    }
  }
  if (newest == nullptr) return "no reachable daemon lists a complete checkpoint of the job";
  return absl::StrCat("the newest complete checkpoint is ", newest->name(), " (step ",
                      newest->step(), "): resume from it (--resume=latest)");
}

}  // namespace

absl::StatusOr<std::vector<GroupPlacement>> ResolvePlacement(
    const std::vector<std::string>& daemons, const ChannelSecurity& security,
    const PlacementOptions& o) {
  const uint32_t n = static_cast<uint32_t>(daemons.size());
  std::vector<std::unique_ptr<v1::Replica::Stub>> stubs;
  for (const std::string& address : daemons) {
    stubs.push_back(v1::Replica::NewStub(MakeDaemonChannel(address, security, std::nullopt, o.liveness_timeout)));
  }
  const absl::Time deadline = absl::Now() + o.wait;
  // Since when each group has seemed lost but for an unreachable daemon.
  std::map<uint32_t, absl::Time> lost_since;
  // A daemon that did not answer keeps that view for rpc_timeout before it
  // is asked again, so that each poll (a rank waiting for the leader's
  // promotion) does not wait out a silent daemon's deadline once more.
  std::vector<DaemonView> views(n);
  std::vector<absl::Time> ask_after(n, absl::InfinitePast());
  for (bool first = true;; first = false) {
    if (!first) absl::SleepFor(absl::Milliseconds(100));
    for (uint32_t d = 0; d < n; ++d) {
      if (absl::Now() < ask_after[d]) continue;
      views[d] = Ask(stubs[d].get(), daemons[d], o.job_id, o.rpc_timeout);
      ask_after[d] = views[d].kind == DaemonView::kUnreachable ? absl::Now() + o.rpc_timeout
                                                                : absl::InfinitePast();
    }
    std::vector<GroupPlacement> out(n);
    std::string waiting;  // why a group is not placed yet
    bool lost = false;
    for (uint32_t g = 0; g < n && waiting.empty(); ++g) {
      const uint32_t holders[2] = {g, ReplicaPeer(g, n)};
      uint64_t top_epoch = 0;
      uint64_t top_step = 0;
      std::optional<uint32_t> primary, backup;
      for (uint32_t h : holders) {
        if (views[h].kind != DaemonView::kHolds) continue;
        auto it = views[h].groups.find(g);
        if (it == views[h].groups.end()) continue;
        const v1::ReplicaGroupState& s = it->second;
        top_epoch = std::max(top_epoch, s.epoch());
        top_step = std::max(top_step, s.committed_step());
        if (s.role() == v1::REPLICA_ROLE_PRIMARY &&
            (!primary || s.epoch() > views[*primary].groups[g].epoch())) {
          primary = h;
        }
        if (s.role() == v1::REPLICA_ROLE_BACKUP && s.in_sync()) backup = h;
      }
      // A primary is valid when no copy of the group carries a newer epoch
      // (a backup at a newer epoch means the primary was replaced).
      if (primary && views[*primary].groups[g].epoch() == top_epoch) {
        out[g] = {daemons[*primary], top_epoch, *primary == g};
        continue;
      }
      // A job (or a group) not started anywhere: its own daemon, epoch 1.
      if (top_epoch <= 1 && top_step == 0 && o.known_committed_step == 0 &&
          views[g].kind != DaemonView::kUnreachable &&
          !(backup && views[*backup].groups[g].prepared())) {
        out[g] = {daemons[g], 1, true};
        continue;
      }
      if (!backup) {
        // No copy left on the daemons that answer: at once when both answer,
        // after lost_grace when the other one does not (it may be hung, not
        // dead, and come back with the group).
        const bool unreachable = views[holders[0]].kind == DaemonView::kUnreachable ||
                                 views[holders[1]].kind == DaemonView::kUnreachable;
        const bool both_unreachable = views[holders[0]].kind == DaemonView::kUnreachable &&
                                      views[holders[1]].kind == DaemonView::kUnreachable;
        const absl::Time since = lost_since.emplace(g, absl::Now()).first->second;
        if (!both_unreachable && (!unreachable || absl::Now() - since >= o.lost_grace)) {
          std::string holding;
          for (uint32_t h : holders) {
            absl::StrAppend(&holding, holding.empty() ? "" : "; ", daemons[h], " ",
                            Holding(views[h], g, top_epoch));
          }
          return absl::DataLossError(absl::StrCat(
              "replica group ", g, " of job ", o.job_id,
              " has no copy left (committed steps up to ", std::max(top_step, o.known_committed_step),
              " are lost with it): ", holding,
              unreachable ? absl::StrCat(" for ", absl::FormatDuration(o.lost_grace)) : "", "; ",
              NewestCheckpoint(daemons, security, views, o)));
        }
        waiting = absl::StrCat(
            "replica group ", g, " of job ", o.job_id, " has no primary and no current backup on ",
            daemons[holders[0]], " (",
            views[holders[0]].error.empty() ? "reachable" : views[holders[0]].error, ") or ",
            daemons[holders[1]], " (",
            views[holders[1]].error.empty() ? "reachable" : views[holders[1]].error, ")");
        continue;
      }
      lost_since.erase(g);
      if (o.rank != 0) {
        waiting = absl::StrCat("replica group ", g,
                               ": waiting for the job leader to promote its "
                               "backup on ",
                               daemons[*backup]);
        continue;
      }
      grpc::ClientContext context;
      // The backup asks the primary's daemon for up to a second first.
      SetDeadline(&context, absl::Now() + std::max(o.rpc_timeout, absl::Seconds(3)));
      v1::PromoteRequest promote;
      promote.set_job_id(o.job_id);
      promote.set_group(g);
      promote.set_epoch(top_epoch + 1);
      promote.set_committed_step(o.known_committed_step);
      v1::ReplicaState state;
      const grpc::Status s = stubs[*backup]->Promote(&context, promote, &state);
      if (!s.ok()) {
        // ABORTED: the backup still reaches its primary, which this rank
        // does not; the placement is read again until the wait ends.
        waiting = DaemonError(s, daemons[*backup], "Promote").ToString();
        lost = s.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
        continue;
      }
      std::fprintf(stderr,
                   "zeroshard: job %s: promoted the backup of replica group %u on %s to "
                   "primary (epoch %llu)\n",
                   o.job_id.c_str(), g, daemons[*backup].c_str(),
                   static_cast<unsigned long long>(top_epoch + 1));
      out[g] = {daemons[*backup], top_epoch + 1, *backup == g};
    }
    if (waiting.empty()) return out;
    if (absl::Now() >= deadline || lost) {
      return absl::FailedPreconditionError(absl::StrCat(
          waiting, lost ? "; its state is lost with the primary: resume from a checkpoint" : ""));
    }
  }
}

}  // namespace zeroshard
