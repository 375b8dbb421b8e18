#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "common/job_id.h"
#include "common/protocol.h"
#include "common/status_macros.h"
#include "server/rpc/job_wire.h"
#include "server/rpc/services.h"

namespace zeroshard {
namespace {

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

// The longest an idle job is kept for its save, counted from the first
// janitor pass that found it idle.
constexpr absl::Duration kIdleSaveWait = absl::Minutes(30);

absl::Status CheckpointDirSet(const ServiceContext& ctx) {
  if (!ctx.checkpoint_dir.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "checkpoints: this daemon was started without --checkpoint_dir");
}

// Requests that name a job not registered here still get a clear answer
// for the checks that need no job.
absl::Status CheckJobId(const std::string& id) {
  if (IsValidJobId(id)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("job_id: must be ", kJobIdRule));
}

}  // namespace

grpc::Status CheckpointService::SaveCheckpoint(grpc::ServerContext* call,
                                               const v1::SaveCheckpointRequest* req,
                                               v1::SaveCheckpointResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  if (absl::Status s = ctx_->PrepareSave(**job); !s.ok()) return ctx_->Done(__func__, s);
  absl::StatusOr<CheckpointSaved> r = (*job)->SaveCheckpoint(req->name(), req->step());
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  ToWire(*r, resp);
  Log(absl::StrCat("job ", req->job_id(), " checkpoint ", req->name(), ": step ", resp->step(),
                   " snapshotted in ", resp->snapshot_seconds(), " s, ", resp->bytes(),
                   " bytes being written"));
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status CheckpointService::GetCheckpointStatus(grpc::ServerContext* context,
                                                    const v1::GetCheckpointStatusRequest* req,
                                                    v1::CheckpointStatus* resp) {
  if (req->wait_ms() > kMaxWaitMs) {
    return ctx_->Done(__func__, absl::InvalidArgumentError(absl::StrCat(
                                    "wait_ms: at most ", kMaxWaitMs, ", got ", req->wait_ms())));
  }
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*context, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  // The wait ends before the caller's deadline, so the answer reaches it.
  absl::Duration wait = absl::Milliseconds(req->wait_ms());
  const absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline != absl::InfiniteFuture()) {
    wait = std::min(wait, (deadline - absl::Now()) - absl::Milliseconds(100));
  }
  absl::StatusOr<CheckpointProgress> s =
      (*job)->CheckpointStatus(req->name(), std::max(wait, absl::ZeroDuration()));
  if (!s.ok()) return ctx_->Done(__func__, s.status());
  ToWire(*std::move(s), resp);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status CheckpointService::CompleteCheckpoint(grpc::ServerContext* call,
                                                   const v1::CompleteCheckpointRequest* req,
                                                   v1::CompleteCheckpointResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  // Reads this daemon's part manifest and writes MANIFEST: on the disk
  // worker, which holds the job until it is done.
  absl::StatusOr<uint64_t> r = ctx_->OnCheckpointDisk<uint64_t>(
      [job = *job, name = req->name(),
       parts = std::vector<v1::PartManifest>(req->parts().begin(), req->parts().end())] {
        return job->CompleteCheckpoint(name, parts);
      });
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  resp->set_step(*r);
  Log(absl::StrCat("job ", req->job_id(), " checkpoint ", req->name(), " of step ", resp->step(),
                   " is complete"));
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status CheckpointService::LoadCheckpoint(grpc::ServerContext* call,
                                               const v1::LoadCheckpointRequest* req,
                                               v1::LoadCheckpointResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  if (absl::Status s = ctx_->CheckFilesOwner(req->job_id(), (*job)->token()); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  absl::StatusOr<CheckpointLoaded> r = (*job)->LoadCheckpoint(req->name());
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  ToWire(*r, resp);
  Log(absl::StrCat("job ", req->job_id(), " loaded checkpoint ", resp->name(), ": step ",
                   resp->step(), ", ", resp->bytes_read(), " bytes read in ", resp->seconds(),
                   " s"));
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status CheckpointService::ListCheckpoints(grpc::ServerContext* call,
                                                const v1::ListCheckpointsRequest* req,
                                                v1::ListCheckpointsResponse* resp) {
  absl::Status s = CheckJobId(req->job_id());
  if (s.ok()) s = ctx_->AuthorizeJobFiles(*call, req->job_id());
  if (s.ok()) s = CheckpointDirSet(*ctx_);
  if (!s.ok()) return ctx_->Done(__func__, s);
  struct Listing {
    std::vector<v1::CheckpointManifest> complete;
    std::vector<PendingPart> pending;
  };
  absl::StatusOr<Listing> listed = ctx_->OnCheckpointDisk<Listing>(
      [dir = ctx_->checkpoint_dir, id = req->job_id()]() -> absl::StatusOr<Listing> {
        Listing l;
        ASSIGN_OR_RETURN(l.complete, ListCompleteCheckpoints(dir, id));
        ASSIGN_OR_RETURN(l.pending, ListPendingParts(dir, id));
        return l;
      });
  if (!listed.ok()) return ctx_->Done(__func__, listed.status());
  for (const v1::CheckpointManifest& m : listed->complete) {
    v1::CheckpointInfo* i = resp->add_checkpoints();
    i->set_name(m.name());
    i->set_step(m.state().committed_step());
    i->set_world_size(m.spec().world_size());
    i->set_daemon_count(static_cast<uint32_t>(m.parts_size()));
    i->set_stage(m.spec().stage());
    uint64_t bytes = 0;
    for (const v1::PartManifest& p : m.parts()) {
      for (const v1::CheckpointFile& f : p.files()) bytes += f.bytes();
    }
    i->set_bytes(bytes);
    i->set_completed_unix_ms(m.completed_unix_ms());
  }
  for (PendingPart& p : listed->pending) {
    v1::PendingCheckpointPart* out = resp->add_pending();
    out->set_name(std::move(p.name));
    *out->mutable_part() = std::move(p.part);
  }
  return ctx_->Done(__func__, absl::OkStatus());
}

absl::Time CheckpointService::IdleSince(const std::shared_ptr<Job>& job) {
  absl::MutexLock lock(&idle_mu_);
  // Entries of jobs gone another way (a rank came back, the job ended).
  for (auto it = idle_since_.begin(); it != idle_since_.end();) {
    it = it->second.job.expired() ? idle_since_.erase(it) : std::next(it);
  }
  auto [it, fresh] = idle_since_.try_emplace(job.get());
  // A new job at the same address, or a rank heard from since: a new idle
  // period.
  if (fresh || it->second.job.lock() != job || job->LastHeard() > it->second.since) {
    it->second = {job, absl::Now()};
  }
  return it->second.since;
}

void CheckpointService::ForgetIdle(const Job& job) {
  absl::MutexLock lock(&idle_mu_);
  idle_since_.erase(&job);
}

bool CheckpointService::SaveBeforeIdleRemoval(const std::shared_ptr<Job>& job) {
  if (ctx_->checkpoint_dir.empty()) return true;
  const JobConfig& config = job->config();
  const uint64_t step = job->committed_step();
  if (step == 0) return true;  // nothing trained since the parameters were set
  const std::string name = absl::StrCat(kIdleCheckpointPrefix, step);
  const std::string what = absl::StrCat("job ", config.job_id, " (idle): part ",
                                        job->daemon_index(), " of checkpoint ", name);
  // A save that never ends does not keep the job for good: counted from the
  // first pass that asked for this job.
  const bool overdue = absl::Now() - IdleSince(job) > kIdleSaveWait;
  const auto done = [&] {
    ForgetIdle(*job);
    return true;
  };
  absl::StatusOr<CheckpointProgress> progress = job->CheckpointStatus(name, absl::ZeroDuration());
  if (absl::IsNotFound(progress.status())) {
    // Not started. Saved already at this step (the trainers' own
    // checkpoint, or the one a resume came from): nothing new to keep.
    absl::StatusOr<std::vector<v1::CheckpointManifest>> complete =
        ListCompleteCheckpoints(ctx_->checkpoint_dir, config.job_id);
    if (complete.ok()) {
      for (const v1::CheckpointManifest& m : *complete) {
        if (m.state().committed_step() == step) return done();
      }
    }
    absl::Status s = ctx_->PrepareSave(*job);
    if (s.ok()) s = job->SaveCheckpoint(name, step).status();
    if (s.ok()) {
      Log(absl::StrCat(what, " (step ", step, "): writing it before the job's removal"));
      return false;
    }
    // The trainers' last save still writes, or the disk does not answer: try
    // again at a later pass.
    if ((absl::IsFailedPrecondition(s) || absl::IsUnavailable(s)) && !overdue) return false;
    Log(absl::StrCat(what, " (step ", step, ") was not saved before the job's removal: ",
                     s.ToString()));
    return done();
  }
  if (!progress.ok()) {
    Log(absl::StrCat(what, ": ", progress.status().ToString(), "; the job is removed unsaved"));
    return done();
  }
  switch (progress->state) {
    case CheckpointProgress::State::kWriting:
      if (!overdue) return false;
      Log(absl::StrCat(what, " still writing after ", absl::FormatDuration(kIdleSaveWait),
                       "; the job is removed"));
      return done();
    case CheckpointProgress::State::kFailed:
      Log(absl::StrCat(what, " failed: ", progress->error.ToString(),
                       "; the job is removed unsaved"));
      return done();
    case CheckpointProgress::State::kWritten:
      break;
  }
  // A job of one daemon is its own whole checkpoint; the others' parts are
  // completed by the client that resumes the job (ListCheckpoints.pending).
  if (config.map.num_daemons() == 1 && progress->part.has_value()) {
    absl::StatusOr<uint64_t> completed = job->CompleteCheckpoint(name, {*progress->part});
    Log(completed.ok() ? absl::StrCat("job ", config.job_id, " (idle): saved checkpoint ", name,
                                      " before its removal")
                       : absl::StrCat(what, " written, not completed: ",
                                      completed.status().ToString()));
    return done();
  }
  Log(absl::StrCat(what, " written before the job's removal; the client that resumes the job ",
                   "completes it with the other daemons' parts"));
  return done();
}

grpc::Status CheckpointService::VerifyCheckpoint(grpc::ServerContext* call,
                                                 const v1::VerifyCheckpointRequest* req,
                                                 v1::VerifyCheckpointResponse* resp) {
  absl::Status s = CheckJobId(req->job_id());
  if (s.ok()) s = ctx_->AuthorizeJobFiles(*call, req->job_id());
  if (s.ok()) s = CheckpointDirSet(*ctx_);
  if (!s.ok()) return ctx_->Done(__func__, s);
  absl::StatusOr<std::string> name =
      ResolveCheckpointName(ctx_->checkpoint_dir, req->job_id(), req->name());
  if (!name.ok()) return ctx_->Done(__func__, name.status());
  absl::StatusOr<v1::CheckpointManifest> m =
      ReadManifest(ctx_->checkpoint_dir, req->job_id(), *name);
  if (!m.ok()) return ctx_->Done(__func__, m.status());
  CheckpointReader reader(ctx_->checkpoint_dir, *m);
  uint64_t bytes = 0;
  s = reader.VerifyPart(req->daemon_index(), &bytes);
  if (!s.ok()) return ctx_->Done(__func__, s);
  resp->set_name(*name);
  resp->set_step(m->state().committed_step());
  resp->set_bytes_read(bytes);
  resp->set_parts(static_cast<uint32_t>(m->parts_size()));
  return ctx_->Done(__func__, absl::OkStatus());
}

}  // namespace zeroshard
