#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "server/rpc/job_wire.h"
#include "server/rpc/grpc_param_fetcher.h"
#include "server/rpc/services.h"

namespace zeroshard {
namespace {

// Largest payload one PushGradient / InitParameters stream may carry; the
// whole stream is held until it is applied atomically.

template <typename Chunk>
uint64_t StreamBytes(const std::vector<Chunk>& chunks) {
  uint64_t bytes = 0;
  for (const Chunk& c : chunks) bytes += c.data().size();
  return bytes;
}

absl::Time DeadlineOf(grpc::ServerContext* ctx) { return absl::FromChrono(ctx->deadline()); }

}  // namespace

// What one buffered chunk costs beyond its payload (the message object and
// its strings), charged so that a stream of empty chunks is bounded too.

// The bytes a stream holds from its first chunk until it has been applied,
// booked as the job's `buffer` and released when the stream is done.
class StreamBooking {
 public:
  explicit StreamBooking(MemoryLedger* ledger) : ledger_(ledger) {}
  StreamBooking(const StreamBooking&) = delete;
  StreamBooking& operator=(const StreamBooking&) = delete;
  ~StreamBooking() {
    if (booked_ > 0) ledger_->Release(job_, MemoryCategory::kBuffer, booked_);
  }
  // Books `bytes` more held for `job`; ResourceExhausted (from the ledger)
  // when the daemon's limit does not allow it.
  absl::Status Add(const std::string& job, uint64_t bytes) {
    job_ = job;
    if (absl::Status s = ledger_->Reserve(job_, MemoryCategory::kBuffer, bytes); !s.ok()) return s;
    booked_ += bytes;
    return absl::OkStatus();
  }

 private:
  MemoryLedger* const ledger_;
  std::string job_;
  uint64_t booked_ = 0;
};

template <typename Chunk>
absl::Status ShardService::ReadStream(const char* rpc, grpc::ServerContext* ctx,
                                      grpc::ServerReader<Chunk>* reader,
                                      std::vector<Chunk>* chunks, std::shared_ptr<Job>* job,
                                      StreamBooking* booking) {
  if (absl::Status s = ctx_->CheckStreamCaller(*ctx, rpc); !s.ok()) return s;
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(ctx);
  Chunk chunk;
  uint64_t bytes = 0;
  uint64_t limit = 0;
  while (watch->Wait([&] { return reader->Read(&chunk); })) {
    if (chunks->empty()) {
      absl::StatusOr<std::shared_ptr<Job>> found = ctx_->FindJob(*ctx, chunk.job_id());
      if (!found.ok()) return found.status();
      *job = *std::move(found);
      limit = MaxPushStreamBytes((*job)->config().bucket_bytes);
    } else if (!chunk.job_id().empty() && chunk.job_id() != (*job)->config().job_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", chunks->size(), ".job_id: the stream started with job ",
          (*job)->config().job_id, ", got ", chunk.job_id().substr(0, 140)));
    }
    // A chunk's data plus its fixed overhead, or its whole size when its
    // lists (no_grad_tensors, tensor_steps) make it larger.
    const uint64_t held =
        std::max<uint64_t>(chunk.data().size() + kPushChunkOverheadBytes, chunk.ByteSizeLong());
    bytes += held;
    if (bytes > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the stream carries more than ", limit, " bytes (", kPushChunkOverheadBytes,
                       " counted per chunk besides its data); split pushes into buckets of at ",
                       "most bucket_bytes per stream"));
    }
    if (absl::Status s = booking->Add((*job)->config().job_id, held); !s.ok()) return s;
    chunks->push_back(std::move(chunk));
    chunk.Clear();
  }
  if (watch->expired()) return ctx_->IdleStreamError(rpc);
  if (ctx->IsCancelled()) {
    return absl::CancelledError("the client abandoned the stream; nothing was applied");
  }
  if (chunks->empty()) return absl::InvalidArgumentError("the stream carried no chunk");
  return absl::OkStatus();
}

grpc::Status ShardService::InitParameters(grpc::ServerContext* ctx,
                                          grpc::ServerReader<v1::ParameterChunk>* reader,
                                          v1::InitParametersResponse* resp) {
  std::vector<v1::ParameterChunk> chunks;
  std::shared_ptr<Job> job;
  StreamBooking booking(ctx_->ledger);
  absl::Status s = ReadStream(__func__, ctx, reader, &chunks, &job, &booking);
  if (!s.ok()) return ctx_->Done(__func__, s);
  uint64_t elements = 0;
  s = job->InitParameters(FromWire(chunks), &elements);
  if (s.ok()) {
    resp->set_elements(elements);
    ctx_->metrics->RecordTraffic(job->config().job_id, "init", "stream", StreamBytes(chunks));
  }
  return ctx_->Done(__func__, s);
}

absl::Status ShardService::DoPush(grpc::ServerContext* ctx,
                                  grpc::ServerReader<v1::GradientChunk>* reader,
                                  v1::PushGradientResponse* resp) {
  std::vector<v1::GradientChunk> chunks;
  std::shared_ptr<Job> job;
  StreamBooking booking(ctx_->ledger);
  if (absl::Status s = ReadStream("PushGradient", ctx, reader, &chunks, &job, &booking); !s.ok()) {
    return s;
  }
  const std::string& id = job->config().job_id;
  // A push waits (for buffer room, for its range's other contributions, for
  // its slot) up to its deadline, and at most kMaxWaitMs: a fence of its
  // slot waits for it.
  const absl::Time deadline =
      std::min(DeadlineOf(ctx), absl::Now() + absl::Milliseconds(kMaxWaitMs));
  const auto staged = std::count_if(chunks.begin(), chunks.end(),
                                    [](const v1::GradientChunk& c) { return c.staged(); });
  // Views of the messages' fields (and data): nothing is copied.
  std::vector<GradientChunkIn> views = FromWire(chunks);
  if (staged == 0) {
    absl::StatusOr<PushResult> r = job->PushGradient(views, deadline);
    if (!r.ok()) return r.status();
    ToWire(*r, resp);
    ctx_->metrics->RecordTraffic(id, "push", "stream", StreamBytes(chunks));
    return absl::OkStatus();
  }
  if (staged != static_cast<std::ptrdiff_t>(chunks.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("a push's chunks are all staged or all inline; got ", chunks.size(),
                     " chunks, ", staged, " staged"));
  }
  // The payloads lie back to back in one slot, in chunk order, from its start.
  const v1::GradientChunk& first = chunks[0];
  absl::StatusOr<DType> dtype = DTypeFromProto(first.dtype(), "chunk 0.dtype");
  if (!dtype.ok()) return dtype.status();
  const uint64_t esize = DTypeSize(*dtype);
  std::vector<uint64_t> lengths(chunks.size());
  uint64_t length = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const v1::GradientChunk& c = chunks[i];
    if (c.staging_slot() != first.staging_slot() ||
        c.staging_generation() != first.staging_generation() || c.rank() != first.rank() ||
        c.incarnation() != first.incarnation() || c.dtype() != first.dtype() ||
        c.push_memory() != first.push_memory()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", i, ": the staged chunks of a push name one rank, incarnation, dtype, slot, ",
          "generation and push memory (chunk 0's: rank ", first.rank(), ", incarnation ",
          first.incarnation(), ", dtype ", first.dtype(), ", slot ", first.staging_slot(),
          ", generation ", first.staging_generation(), ", push memory ", first.push_memory(),
          ")"));
    }
    if (c.push_memory() == 0 && c.push_memory_offset() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", i, ": push_memory_offset ", c.push_memory_offset(),
          " without a push_memory"));
    }
    if (!c.data().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", i, ": a staged chunk carries no data, got ", c.data().size(), " bytes"));
    }
    if (c.range().end() <= c.range().begin() ||
        c.range().end() - c.range().begin() > kMaxChunkBytes / esize) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", i, ".range [", c.range().begin(),
                                                     ", ", c.range().end(),
                                                     ") is empty or too long for a staged chunk"));
    }
    lengths[i] = (c.range().end() - c.range().begin()) * esize;
    length += lengths[i];  // at most chunks * kMaxChunkBytes: no overflow
  }
  absl::StatusOr<std::shared_ptr<RankStaging>> staging =
      job->Staging(first.rank(), first.incarnation(), /*create=*/false);
  if (!staging.ok()) return staging.status();
  // The slot's lock is held while the job reads the bytes: a fence of the
  // slot waits for this push, and refuses it if it came first.
  const bool pulled = first.push_memory() != 0;
  absl::Status s = (*staging)->Apply(
      first.staging_slot(), first.staging_generation(), length,
      [&](absl::string_view source) -> absl::Status {
        for (size_t i = 0, at = 0; i < chunks.size(); at += lengths[i], ++i) {
          if (!pulled) {
            views[i].payload = source.substr(at, lengths[i]);
            continue;
          }
          // In the trainer's memory: each payload where its chunk says.
          const uint64_t offset = chunks[i].push_memory_offset();
          if (offset % esize != 0) {
            return absl::InvalidArgumentError(absl::StrCat(
                "chunk ", i, ": push_memory_offset ", offset, " is not a multiple of ", esize,
                " (the payload's element size)"));
          }
          if (offset > source.size() || lengths[i] > source.size() - offset) {
            return absl::InvalidArgumentError(absl::StrCat(
                "chunk ", i, ": ", lengths[i], " bytes at push_memory_offset ", offset,
                " overrun push memory ", first.push_memory(), " (", source.size(), " bytes)"));
          }
          views[i].payload = source.substr(offset, lengths[i]);
          views[i].pulled = true;
        }
        absl::StatusOr<PushResult> r = job->PushGradient(views, deadline);
        if (!r.ok()) return r.status();
        ToWire(*r, resp);
        return absl::OkStatus();
      },
      first.push_memory(), deadline);
  if (s.ok()) {
    ctx_->metrics->RecordTraffic(id, "push", pulled ? "push_memory" : ctx_->bulk->kind(), length);
  }
  return s;
}

grpc::Status ShardService::PushGradient(grpc::ServerContext* ctx,
                                        grpc::ServerReader<v1::GradientChunk>* reader,
                                        v1::PushGradientResponse* resp) {
  return ctx_->Done(__func__, DoPush(ctx, reader, resp));
}

absl::Status ShardService::DoGather(grpc::ServerContext* ctx, const v1::GatherRequest& req,
                                    grpc::ServerWriter<v1::ParameterChunk>* writer) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*ctx, req.job_id());
  if (!job.ok()) return job.status();
  absl::StatusOr<DType> dtype = DTypeFromProto(req.dtype(), "dtype");
  if (!dtype.ok()) return dtype.status();
  const JobConfig& c = (*job)->config();
  if (*dtype != DType::kFp32 && *dtype != c.precision) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: must be fp32 or the job's precision (",
                                                   DTypeName(c.precision), "), got ",
                                                   DTypeName(*dtype)));
  }
  if (req.wait_ms() > kMaxWaitMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_ms: at most ", kMaxWaitMs, ", got ", req.wait_ms()));
  }
  if (req.unreported_read_bytes() > kMaxUnreportedReadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("unreported_read_bytes: at most ",
                                                   kMaxUnreportedReadBytes, ", got ",
                                                   req.unreported_read_bytes()));
  }
  if (req.unreported_read_bytes() != 0 && !req.wait_only()) {
    return absl::InvalidArgumentError(
        "unreported_read_bytes: only with wait_only (a bulk reader's report of its reads)");
  }
  const absl::Time deadline =
      std::min(absl::Now() + absl::Milliseconds(req.wait_ms()), DeadlineOf(ctx));
  const uint64_t chunk_elements =
      std::max<uint64_t>(1, ctx_->max_chunk_bytes / DTypeSize(*dtype));
  const FlatRange range{req.range().begin(), req.range().end()};
  if ((*job)->param_cache() != nullptr && ctx_->peer_gather != nullptr &&
      !(*job)->owned_unpadded().Contains(range)) {
    return GatherThroughNodeCache(ctx, req, **job, range, *dtype, deadline, chunk_elements,
                                  writer);
  }
  if (req.wait_only()) {
    // The caller reads the range from the parameter regions itself.
    absl::Status s = (*job)->Gather(req.after_step(), range, *dtype, deadline, chunk_elements,
                                    nullptr);
    if (s.ok() && ctx_->bulk != nullptr) {
      ctx_->metrics->RecordTraffic(req.job_id(), "gather", ctx_->bulk->kind(),
                                   range.size() * DTypeSize(*dtype) + req.unreported_read_bytes());
    }
    return s;
  }
  uint64_t bytes = 0;
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(ctx);
  v1::ParameterChunk message;
  message.set_job_id(c.job_id);
  absl::Status s = (*job)->Gather(req.after_step(), range, *dtype, deadline, chunk_elements,
                                  [&](ParameterChunkOut& chunk) {
                                    bytes += chunk.data.size();
                                    SwapToWire(chunk, &message);
                                    const bool written =
                                        watch->Wait([&] { return writer->Write(message); });
                                    SwapBack(&message, chunk);
                                    return written;
                                  });
  ctx_->metrics->RecordTraffic(req.job_id(), "gather", "stream", bytes);
  if (watch->expired()) return ctx_->IdleStreamError("Gather");
  return s;
}

absl::Status ShardService::GatherThroughNodeCache(grpc::ServerContext* ctx,
                                                  const v1::GatherRequest& req, Job& job,
                                                  const FlatRange& range, DType dtype,
                                                  absl::Time deadline, uint64_t chunk_elements,
                                                  grpc::ServerWriter<v1::ParameterChunk>* writer) {
  const JobConfig& c = job.config();
  if (req.wait_only()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range: [", range.begin, ", ", range.end, ") lies outside the parameters this daemon ",
        "owns [", job.owned_unpadded().begin, ", ", job.owned_unpadded().end,
        "); a wait_only gather reads this daemon's own regions (the node cache serves streamed ",
        "gathers only)"));
  }
  if (range.begin >= range.end || range.end > c.map.total_elements()) {
    return absl::InvalidArgumentError(absl::StrCat("range: [", range.begin, ", ", range.end,
                                                   ") is empty or outside the parameters [0, ",
                                                   c.map.total_elements(), ")"));
  }
  if (req.after_step() > job.committed_step() + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "after_step: job ", c.job_id, " has committed step ", job.committed_step(), "; step ",
        req.after_step(), " cannot be committed before step ", job.committed_step() + 1));
  }
  if (!job.AwaitCommit(req.after_step(), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("job ", c.job_id, ": step ", req.after_step(),
                                                    " was not committed in time (committed: ",
                                                    job.committed_step(), ")"));
  }
  // Every part is served at the step committed here now; an owner (or this
  // daemon) found at another one tears the stream (ABORTED: gather again).
  const uint64_t step = std::max(req.after_step(), job.committed_step());
  // The fetch from the owners, and the wait for another gather's fetch,
  // take up to the call's deadline (at most kMaxWaitMs): wait_ms bounds
  // only the wait for this daemon's commit, as for other gathers.
  deadline = std::min(DeadlineOf(ctx), absl::Now() + absl::Milliseconds(kMaxWaitMs));
  const std::string token = PresentedToken(ctx->client_metadata()).value_or("");
  GrpcParamFetcher fetcher(ctx_->peer_gather, &c, token);
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(ctx);
  const size_t esize = DTypeSize(dtype);
  uint64_t bytes = 0;
  v1::ParameterChunk chunk;
  chunk.set_job_id(c.job_id);
  chunk.set_dtype(WireDType(dtype));
  chunk.set_step(step);
  // Sends [b, e) of `src` (the bytes of element b first) in chunks.
  auto send = [&](const FlatRange& part, const uint8_t* src) -> absl::Status {
    for (uint64_t pos = part.begin; pos < part.end;) {
      const uint64_t end = std::min(part.end, pos + chunk_elements);
      chunk.set_data(reinterpret_cast<const char*>(src) + (pos - part.begin) * esize,
                     (end - pos) * esize);
      chunk.mutable_range()->set_begin(pos);
      chunk.mutable_range()->set_end(end);
      chunk.set_crc32c(Crc32c(chunk.data().data(), chunk.data().size()));
      bytes += chunk.data().size();
      if (!watch->Wait([&] { return writer->Write(chunk); })) {
        return absl::CancelledError("the gathering client went away");
      }
      pos = end;
    }
    return absl::OkStatus();
  };
  const FlatRange owned = job.owned_unpadded();
  std::shared_ptr<const ParamCache::Copy> copy;  // fetched once, for the parts outside `owned`
  bool pass_through = dtype != job.param_cache()->dtype();
  std::vector<uint8_t> piece;  // a pass-through part, booked as buffer while held
  StreamBooking booking(ctx_->ledger);
  absl::Status s;
  const FlatRange parts[] = {{range.begin, std::min(range.end, owned.begin)},
                             range.Intersect(owned),
                             {std::max(range.begin, owned.end), range.end}};
  for (const FlatRange& part : parts) {
    if (!s.ok() || part.size() == 0) continue;
    if (owned.Contains(part)) {
      bool torn = false;
      v1::ParameterChunk message;
      message.set_job_id(c.job_id);
      s = job.Gather(step, part, dtype, deadline, chunk_elements, [&](ParameterChunkOut& mine) {
        if (mine.step != step) {
          torn = true;
          return false;
        }
        bytes += mine.data.size();
        SwapToWire(mine, &message);
        const bool written = watch->Wait([&] { return writer->Write(message); });
        SwapBack(&message, mine);
        return written;
      });
      if (torn) {
        s = absl::AbortedError(absl::StrCat("job ", c.job_id, ": step ", step + 1,
                                            " was committed while step ", step,
                                            " was being gathered; gather again"));
      }
      continue;
    }
    if (!pass_through && copy == nullptr) {
      ParamCache::Counts served;
      absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> got =
          job.param_cache()->Get(step, fetcher, deadline, &served);
      ctx_->metrics->RecordNodeCache(c.job_id, served.hits, served.fetches, served.bytes_fetched);
      if (got.ok()) {
        copy = *std::move(got);
      } else if (absl::IsFailedPrecondition(got.status()) ||
                 absl::IsResourceExhausted(got.status())) {
        // An older step than the cache's, or no room for a copy: this
        // request goes to the owners itself.
        if (absl::IsResourceExhausted(got.status())) {
          std::fprintf(stderr, "zeroshardd: job %s: node cache off for step %llu: %s\n",
                       c.job_id.c_str(), static_cast<unsigned long long>(step),
                       std::string(got.status().message()).c_str());
        }
        pass_through = true;
      } else {
        s = got.status();
        continue;
      }
    }
    if (!pass_through) {
      s = send(part, copy->At(part));
      continue;
    }
    // Pass-through, one owner's piece of at most a chunk at a time.
    for (uint64_t pos = part.begin; s.ok() && pos < part.end;) {
      const uint32_t owner =
          c.map.DaemonOf(static_cast<uint32_t>(pos / c.map.partition_elements()));
      const FlatRange take{pos, std::min({part.end, pos + chunk_elements,
                                          c.map.DaemonRange(owner).end})};
      if (piece.size() < take.size() * esize) {
        if (s = booking.Add(c.job_id, take.size() * esize - piece.size()); !s.ok()) break;
        piece.resize(take.size() * esize);
      }
      absl::StatusOr<uint64_t> at = fetcher.Fetch(owner, take, dtype, step, deadline, piece.data());
      if (!at.ok()) {
        s = at.status();
      } else if (*at != step) {
        s = absl::AbortedError(absl::StrCat("job ", c.job_id, ": daemon ", owner,
                                            " answered step ", *at, " for step ", step,
                                            "; gather again"));
      } else {
        s = send(take, piece.data());
      }
      pos = take.end;
    }
  }
  ctx_->metrics->RecordTraffic(req.job_id(), "gather", "stream", bytes);
  if (watch->expired()) return ctx_->IdleStreamError("Gather");
  return s;
}

grpc::Status ShardService::Gather(grpc::ServerContext* ctx, const v1::GatherRequest* req,
                                  grpc::ServerWriter<v1::ParameterChunk>* writer) {
  return ctx_->Done(__func__, DoGather(ctx, *req, writer));
}

grpc::Status ShardService::PrepareStep(grpc::ServerContext* call, const v1::PrepareStepRequest* req,
                                       v1::PrepareStepResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  // Only the leader prepares: preparing freezes the step for every rank.
  if (req->rank() != 0) {
    return ctx_->Done(__func__, absl::InvalidArgumentError(absl::StrCat(
                                    "rank: only the job leader (rank 0) prepares, got rank ",
                                    req->rank())));
  }
  if (absl::Status s = (*job)->CheckRank(req->rank(), req->incarnation(), ""); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  absl::StatusOr<PrepareResult> r =
      (*job)->PrepareStep(req->step(), PresentedToken(call->client_metadata()).value_or(""));
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  ToWire(*r, resp);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ShardService::CommitStep(grpc::ServerContext* call, const v1::CommitStepRequest* req,
                                      v1::CommitStepResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  // The step engine records the optimizer's time (zeroshard_optimizer_seconds).
  absl::StatusOr<CommitResult> r = (*job)->CommitStep(
      FromWire(*req), PresentedToken(call->client_metadata()).value_or(""));
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  ToWire(*r, resp);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ShardService::GetStepState(grpc::ServerContext* call,
                                        const v1::GetStepStateRequest* req, v1::StepState* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id(), /*serving=*/false);
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  if (req->wait_ms() > kMaxWaitMs) {
    return ctx_->Done(__func__, absl::InvalidArgumentError(absl::StrCat(
                                    "wait_ms: at most ", kMaxWaitMs, ", got ", req->wait_ms())));
  }
  if (req->wait_for_step() > 0) {
    (*job)->AwaitCommit(
        req->wait_for_step(),
        std::min(absl::Now() + absl::Milliseconds(req->wait_ms()), DeadlineOf(call)));
  }
  ToWire((*job)->StepState(ctx_->jobs->options().rank_timeout, req->brief()), resp);
  if (std::optional<ReplicaGroupStatus> r = (*job)->ReplicaState(); r.has_value()) {
    ToWire(*r, resp->mutable_replica());
  }
  return ctx_->Done(__func__, absl::OkStatus());
}

absl::Status ShardService::DoExchangeEndpoint(const grpc::ServerContext& call,
                                              const v1::ExchangeEndpointRequest& req,
                                              v1::ExchangeEndpointResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(call, req.job_id());
  if (!job.ok()) return job.status();
  if (ctx_->bulk == nullptr) {
    return absl::UnavailableError(absl::StrCat("this zeroshardd serves no bulk transport (",
                                               ctx_->bulk_error,
                                               "); use the \"stream\" data path"));
  }
  const absl::StatusOr<v1::TransportKind> mine =
      TransportKindFromName(ctx_->bulk->kind(), "--bulk_transport");
  if (!mine.ok()) return absl::InternalError(mine.status().message());
  if (req.transport() != *mine) {
    return absl::FailedPreconditionError(absl::StrCat(
        "transport: this daemon's bulk transport is ", ctx_->bulk->kind(), ", got ",
        TransportKindName(req.transport()), "; start the client with transport \"",
        ctx_->bulk->kind(), "\""));
  }
  // Keys go to joined ranks only (Staging checks the rank and incarnation).
  absl::StatusOr<std::shared_ptr<RankStaging>> staging =
      (*job)->Staging(req.rank(), req.incarnation(), /*create=*/true);
  if (!staging.ok()) return staging.status();
  resp->set_worker_address(ctx_->bulk->LocalAddress());
  resp->set_transport(*mine);
  resp->set_staging_slots((*staging)->slots());
  resp->set_staging_slot_bytes((*staging)->slot_bytes());
  resp->set_read_lease_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(ctx_->jobs->options().read_lease)));
  v1::RemoteRegion* r = resp->add_regions();
  const transport::RegionDescriptor& d = (*staging)->descriptor();
  r->set_purpose(v1::REGION_PURPOSE_GRAD_STAGING);
  r->set_address(d.address);
  r->set_length(d.length);
  r->set_rkey(d.rkey);
  ToWire((*job)->ParameterRegions(), resp);
  if (ctx_->activations != nullptr) {
    // The arena's key reaches every job's slices: lent to one job at a time.
    const Job* self = job->get();
    absl::StatusOr<bool> lent =
        ctx_->arena_tenancy->Lend(self, *job, req.job_id(), ctx_->activations);
    if (!lent.ok()) return lent.status();
    if (*lent) ctx_->activations->FillRegion(resp);
  }
  (*job)->NoteRemoteAccess();
  return absl::OkStatus();
}

grpc::Status ShardService::ExchangeEndpoint(grpc::ServerContext* call,
                                            const v1::ExchangeEndpointRequest* req,
                                            v1::ExchangeEndpointResponse* resp) {
  return ctx_->Done(__func__, DoExchangeEndpoint(*call, *req, resp));
}

absl::StatusOr<std::shared_ptr<RankStaging>> ShardService::ExchangedStaging(
    const grpc::ServerContext& call, const std::string& job_id, uint32_t rank,
    uint64_t incarnation, std::shared_ptr<Job>* job) {
  absl::StatusOr<std::shared_ptr<Job>> found = ctx_->FindJob(call, job_id);
  if (!found.ok()) return found.status();
  if (job != nullptr) *job = *found;
  return (*found)->Staging(rank, incarnation, /*create=*/false);
}

grpc::Status ShardService::FenceStagingSlot(grpc::ServerContext* call,
                                            const v1::FenceStagingSlotRequest* req,
                                            v1::FenceStagingSlotResponse* resp) {
  absl::StatusOr<std::shared_ptr<RankStaging>> staging =
      ExchangedStaging(*call, req->job_id(), req->rank(), req->incarnation());
  if (!staging.ok()) return ctx_->Done(__func__, staging.status());
  absl::StatusOr<uint64_t> applied =
      (*staging)->Fence(req->slot(), req->generation(), DeadlineOf(call));
  if (!applied.ok()) return ctx_->Done(__func__, applied.status());
  resp->set_applied_generation(*applied);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ShardService::MapPushMemory(grpc::ServerContext* call,
                                         const v1::MapPushMemoryRequest* req,
                                         v1::MapPushMemoryResponse* resp) {
  std::shared_ptr<Job> job;
  absl::StatusOr<std::shared_ptr<RankStaging>> staging =
      ExchangedStaging(*call, req->job_id(), req->rank(), req->incarnation(), &job);
  if (!staging.ok()) return ctx_->Done(__func__, staging.status());
  // Twice the job's gradient in fp32 (a trainer's gradients and its
  // staging pool), and 1 GiB: what reads of holes in it could make this
  // daemon's memory grow by, at most, per rank process.
  const uint64_t max_bytes = 2 * job->config().map.total_elements() * sizeof(float) +
                             (uint64_t{1} << 30);
  absl::StatusOr<uint32_t> id = (*staging)->MapPushMemory(req->pid(), req->fd(), req->name(),
                                                          req->bytes(), max_bytes);
  if (!id.ok()) return ctx_->Done(__func__, id.status());
  resp->set_id(*id);
  resp->set_daemon_pid(::getpid());
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ShardService::ReadState(grpc::ServerContext* ctx, const v1::ReadStateRequest* req,
                                     grpc::ServerWriter<v1::StateChunk>* writer) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*ctx, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  const uint64_t chunk_elements = std::max<uint64_t>(1, ctx_->max_chunk_bytes / sizeof(float));
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(ctx);
  v1::StateChunk message;
  message.set_job_id((*job)->config().job_id);
  message.set_array(req->array());
  absl::Status s = (*job)->ReadState(
      req->rank(), req->incarnation(), req->array(), {req->range().begin(), req->range().end()},
      chunk_elements, [&](StateChunkOut& c) {
        SwapToWire(c, &message);
        const bool written = watch->Wait([&] { return writer->Write(message); });
        SwapBack(&message, c);
        return written;
      });
  if (watch->expired()) s = ctx_->IdleStreamError(__func__);
  return ctx_->Done(__func__, s);
}

grpc::Status ShardService::WriteState(grpc::ServerContext* ctx,
                                      grpc::ServerReader<v1::StateChunk>* reader,
                                      v1::WriteStateResponse* resp) {
  std::vector<v1::StateChunk> chunks;
  std::shared_ptr<Job> job;
  StreamBooking booking(ctx_->ledger);
  absl::Status s = ReadStream(__func__, ctx, reader, &chunks, &job, &booking);
  if (!s.ok()) return ctx_->Done(__func__, s);
  absl::StatusOr<WriteStateResult> r = job->WriteState(FromWire(chunks));
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  ToWire(*r, resp);
  return ctx_->Done(__func__, absl::OkStatus());
}

}  // namespace zeroshard
