#include "client/checkpoint_driver.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/rpc.h"
#include "common/checkpoint_files.h"
#include "common/protocol.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

// Between CompleteCheckpoint calls to a daemon whose disk did not answer.
constexpr absl::Duration kCompleteRetryWait = absl::Seconds(1);

// Runs fn(d) for every daemon on its own thread; the first error by daemon
// order. The calls are blocking RPCs with deadlines, so this ends.
absl::Status ForEach(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t d = 0; d < n; ++d) threads.emplace_back([&, d] { results[d] = fn(d); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

CheckpointDriver::CheckpointDriver(std::string job_id, std::vector<std::string> addresses,
                                   std::vector<std::shared_ptr<grpc::Channel>> channels)
    : job_id_(std::move(job_id)), addresses_(std::move(addresses)) {
  for (const auto& c : channels) stubs_.push_back(v1::Checkpoint::NewStub(c));
}

std::unique_ptr<CheckpointDriver> CheckpointDriver::Connect(std::string job_id,
                                                            std::vector<std::string> addresses,
                                                            const ChannelSecurity& security) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const std::string& a : addresses) channels.push_back(MakeDaemonChannel(a, security));
  return std::make_unique<CheckpointDriver>(std::move(job_id), std::move(addresses),
                                            std::move(channels));
}

absl::StatusOr<CheckpointStarted> CheckpointDriver::Start(const std::string& name,
                                                          uint64_t step, absl::Time deadline) {
  std::vector<v1::SaveCheckpointResponse> out(stubs_.size());
  RETURN_IF_ERROR(ForEach(stubs_.size(), [&](size_t d) -> absl::Status {
    v1::SaveCheckpointRequest req;
    req.set_job_id(job_id_);
    req.set_name(name);
    req.set_step(step);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    const grpc::Status s = stubs_[d]->SaveCheckpoint(&ctx, req, &out[d]);
    return s.ok() ? absl::OkStatus() : DaemonError(s, addresses_[d], "SaveCheckpoint");
  }));
  CheckpointStarted started;
  started.name = name;
  started.step = step;
  for (const auto& r : out) {
    started.bytes += r.bytes();
    started.snapshot_seconds = std::max(started.snapshot_seconds, r.snapshot_seconds());
  }
  return started;
}

absl::StatusOr<CheckpointCompleted> CheckpointDriver::Finish(const std::string& name,
                                                             absl::Time deadline) {
  std::vector<v1::PartManifest> parts(stubs_.size());
  RETURN_IF_ERROR(ForEach(stubs_.size(), [&](size_t d) -> absl::Status {
    for (;;) {
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "daemon ", addresses_[d], ": checkpoint ", job_id_, "/", name,
            " was still being written at the deadline"));
      }
      // Long-poll in slices so the deadline is kept even by a daemon that
      // answers late.
      const absl::Duration wait =
          std::min(absl::Seconds(10), std::max(deadline - now - absl::Seconds(1),
                                               absl::Milliseconds(10)));
      v1::GetCheckpointStatusRequest req;
      req.set_job_id(job_id_);
      req.set_name(name);
      req.set_wait_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(wait)));
      grpc::ClientContext ctx;
      SetDeadline(&ctx, std::min(deadline, now + wait + absl::Seconds(5)));
      v1::CheckpointStatus st;
      const grpc::Status s = stubs_[d]->GetCheckpointStatus(&ctx, req, &st);
      if (!s.ok()) return DaemonError(s, addresses_[d], "GetCheckpointStatus");
      switch (st.state()) {
        case v1::CheckpointStatus::STATE_WRITTEN:
          parts[d] = st.part();
          return absl::OkStatus();
        case v1::CheckpointStatus::STATE_FAILED:
          return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                              absl::StrCat("daemon ", addresses_[d], ": writing checkpoint ",
                                           job_id_, "/", name, ": ", st.error()));
        default:
          break;  // still writing
      }
    }
  }));
  std::sort(parts.begin(), parts.end(), [](const v1::PartManifest& a, const v1::PartManifest& b) {
    return a.daemon_index() < b.daemon_index();
  });
  v1::CompleteCheckpointRequest complete;
  complete.set_job_id(job_id_);
  complete.set_name(name);
  for (const auto& p : parts) *complete.add_parts() = p;
  RETURN_IF_ERROR(ForEach(stubs_.size(), [&](size_t d) -> absl::Status {
    // Idempotent: asked again while the daemon's disk does not answer
    // (UNAVAILABLE), until the deadline.
    for (;;) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, deadline);
      v1::CompleteCheckpointResponse r;
      const grpc::Status s = stubs_[d]->CompleteCheckpoint(&ctx, complete, &r);
      if (s.ok()) return absl::OkStatus();
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
          absl::Now() + kCompleteRetryWait >= deadline) {
        return DaemonError(s, addresses_[d], "CompleteCheckpoint");
      }
      absl::SleepFor(kCompleteRetryWait);
    }
  }));
  CheckpointCompleted done;
  done.name = name;
  done.step = parts.empty() ? 0 : parts[0].state().committed_step();
  for (const auto& p : parts) {
    for (const auto& f : p.files()) done.bytes += f.bytes();
    done.write_seconds = std::max(done.write_seconds, p.write_seconds());
  }
  return done;
}

absl::StatusOr<v1::LoadCheckpointResponse> CheckpointDriver::Load(const std::string& name,
                                                                  absl::Time deadline) {
  std::vector<v1::LoadCheckpointResponse> out(stubs_.size());
  auto load = [&](size_t d, const std::string& n) -> absl::Status {
    v1::LoadCheckpointRequest req;
    req.set_job_id(job_id_);
    req.set_name(n);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    const grpc::Status s = stubs_[d]->LoadCheckpoint(&ctx, req, &out[d]);
    return s.ok() ? absl::OkStatus() : DaemonError(s, addresses_[d], "LoadCheckpoint");
  };
  if (stubs_.empty()) return absl::InvalidArgumentError("no daemons");
  // Daemon 0 resolves "latest"; the others load what it loaded.
  RETURN_IF_ERROR(load(0, name));
  const std::string resolved = out[0].name();
  RETURN_IF_ERROR(ForEach(stubs_.size() - 1, [&](size_t i) { return load(i + 1, resolved); }));
  for (size_t d = 1; d < out.size(); ++d) {
    if (out[d].step() != out[0].step()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", job_id_, "/", resolved, ": daemon ", addresses_[0], " loaded step ",
          out[0].step(), ", daemon ", addresses_[d], " step ", out[d].step()));
    }
  }
  return out[0];
}

absl::StatusOr<LatestLoad> CheckpointDriver::LoadLatestVerified(absl::Time deadline) {
  ASSIGN_OR_RETURN(std::vector<v1::CheckpointInfo> complete, List(deadline));
  if (complete.empty()) {
    return absl::NotFoundError(
        absl::StrCat("job ", job_id_, " has no complete checkpoint on its daemons"));
  }
  std::sort(complete.begin(), complete.end(),
            [](const v1::CheckpointInfo& a, const v1::CheckpointInfo& b) {
              return a.step() > b.step();
            });
  LatestLoad out;
  for (const v1::CheckpointInfo& c : complete) {
    absl::Status verified = Verify(c.name(), deadline).status();
    if (verified.ok()) {
      ASSIGN_OR_RETURN(out.loaded, Load(c.name(), deadline));
      return out;
    }
    // A daemon that cannot be reached says nothing about the checkpoint.
    if (absl::IsUnavailable(verified) || absl::IsDeadlineExceeded(verified)) return verified;
    out.skipped.push_back(
        absl::StrCat(c.name(), " (step ", c.step(), "): ", verified.message()));
  }
  return absl::DataLossError(absl::StrCat("no complete checkpoint of job ", job_id_,
                                          " verifies: ", absl::StrJoin(out.skipped, "; ")));
}

absl::StatusOr<std::vector<v1::ListCheckpointsResponse>> CheckpointDriver::ListEach(
    absl::Time deadline) {
  std::vector<v1::ListCheckpointsResponse> out(stubs_.size());
  RETURN_IF_ERROR(ForEach(stubs_.size(), [&](size_t d) -> absl::Status {
    v1::ListCheckpointsRequest req;
    req.set_job_id(job_id_);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    const grpc::Status s = stubs_[d]->ListCheckpoints(&ctx, req, &out[d]);
    return s.ok() ? absl::OkStatus() : DaemonError(s, addresses_[d], "ListCheckpoints");
  }));
  return out;
}

bool CheckpointDriver::CompletePending(const std::vector<v1::ListCheckpointsResponse>& lists,
                                       absl::Time deadline) {
  const uint32_t n = static_cast<uint32_t>(stubs_.size());
  std::map<std::string, std::map<uint32_t, v1::PartManifest>> pending;  // name -> index -> part
  for (const v1::ListCheckpointsResponse& r : lists) {
    for (const v1::PendingCheckpointPart& p : r.pending()) {
      // Only what daemons saved of an idle job; a save its trainers left
      // incomplete stays so.
      if (absl::StartsWith(p.name(), kIdleCheckpointPrefix) && p.part().daemon_count() == n &&
          p.part().daemon_index() < n) {
        pending[p.name()].emplace(p.part().daemon_index(), p.part());
      }
    }
  }
  bool completed = false;
  for (const auto& [name, parts] : pending) {
    if (parts.size() != n) continue;  // a part is missing (or still being written)
    v1::CompleteCheckpointRequest complete;
    complete.set_job_id(job_id_);
    complete.set_name(name);
    for (const auto& [index, part] : parts) *complete.add_parts() = part;
    const absl::Status s = ForEach(n, [&](size_t d) -> absl::Status {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, deadline);
      v1::CompleteCheckpointResponse r;
      const grpc::Status st = stubs_[d]->CompleteCheckpoint(&ctx, complete, &r);
      return st.ok() ? absl::OkStatus() : DaemonError(st, addresses_[d], "CompleteCheckpoint");
    });
    if (s.ok()) {
      std::fprintf(stderr,
                   "zeroshard: job %s: completed checkpoint %s (step %llu) from the parts its "
                   "daemons saved before removing the idle job\n",
                   job_id_.c_str(), name.c_str(),
                   static_cast<unsigned long long>(parts.begin()->second.state().committed_step()));
      completed = true;
    } else {
      std::fprintf(stderr, "zeroshard: job %s: checkpoint %s stays incomplete: %s\n",
                   job_id_.c_str(), name.c_str(), std::string(s.message()).c_str());
    }
  }
  return completed;
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> CheckpointDriver::List(absl::Time deadline) {
  ASSIGN_OR_RETURN(std::vector<v1::ListCheckpointsResponse> out, ListEach(deadline));
  if (CompletePending(out, deadline)) {
    ASSIGN_OR_RETURN(out, ListEach(deadline));
  }
  // Complete on every daemon: in every list.
  std::map<std::string, int> seen;
  for (const auto& r : out) {
    for (const auto& c : r.checkpoints()) ++seen[c.name()];
  }
  std::vector<v1::CheckpointInfo> all;
  if (out.empty()) return all;
  for (const auto& c : out[0].checkpoints()) {
    if (seen[c.name()] == static_cast<int>(out.size())) all.push_back(c);
  }
  return all;
}

absl::StatusOr<v1::VerifyCheckpointResponse> CheckpointDriver::Verify(const std::string& name,
                                                                      absl::Time deadline) {
  if (stubs_.empty()) return absl::InvalidArgumentError("no daemons");
  auto verify = [&](size_t d, uint32_t part, const std::string& n,
                    v1::VerifyCheckpointResponse* r) -> absl::Status {
    v1::VerifyCheckpointRequest req;
    req.set_job_id(job_id_);
    req.set_name(n);
    req.set_daemon_index(part);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    const grpc::Status s = stubs_[d]->VerifyCheckpoint(&ctx, req, r);
    return s.ok() ? absl::OkStatus()
                  : DaemonError(s, addresses_[d], absl::StrCat("VerifyCheckpoint of part ", part));
  };
  v1::VerifyCheckpointResponse first;
  RETURN_IF_ERROR(verify(0, 0, name, &first));
  // Part p is verified by daemon p (mod the daemons here): each daemon reads
  // the part it wrote when the job kept its shape.
  std::vector<v1::VerifyCheckpointResponse> rest(first.parts());
  const uint32_t parts = first.parts();
  RETURN_IF_ERROR(ForEach(parts > 0 ? parts - 1 : 0, [&](size_t i) {
    const uint32_t part = static_cast<uint32_t>(i + 1);
    return verify(part % stubs_.size(), part, first.name(), &rest[part]);
  }));
  v1::VerifyCheckpointResponse all = first;
  for (const auto& r : rest) all.set_bytes_read(all.bytes_read() + r.bytes_read());
  return all;
}

}  // namespace zeroshard
