#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/activation_protocol.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "common/status_macros.h"
#include "server/rpc/services.h"

namespace zeroshard {
namespace {

absl::Time DeadlineOf(grpc::ServerContext* ctx) {
  return std::min(absl::FromChrono(ctx->deadline()),
                  absl::Now() + ActivationService::kMaxActivationWait);
}

// The request's key `field`, validated (common/activation_protocol.h).
absl::StatusOr<ActivationKey> KeyOf(const v1::ActivationKey& k, bool has_key,
                                    absl::string_view field) {
  if (!has_key) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  return ParseActivationKey(k, field);
}

absl::Status CheckBytes(uint64_t bytes, const ActivationStore& store, absl::string_view field) {
  RETURN_IF_ERROR(ValidateActivationSliceBytes(bytes, field));
  if (bytes > store.capacity()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", bytes, " bytes is more than this daemon's activation arena holds (",
        "--activation_arena_bytes=", store.arena_bytes(), ", ", store.capacity(),
        " B usable); split the checkpoint, or use more model-parallel slices"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SliceOwner> ActivationService::Owner(const grpc::ServerContext& call,
                                                    const v1::ActivationOwner& o, bool has_owner) {
  if (ctx_->activations == nullptr) {
    return absl::FailedPreconditionError(
        "this zeroshardd keeps no activations (started with --activation_arena_bytes=0)");
  }
  if (!has_owner) return absl::InvalidArgumentError("owner: required");
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, ctx_->FindJob(call, o.job_id()));
  RETURN_IF_ERROR(job->CheckRank(o.rank(), o.incarnation(), "owner."));
  RETURN_IF_ERROR(ctx_->arena_tenancy->Check(job.get()));
  SliceOwner owner;
  owner.job_id = o.job_id();
  owner.instance = std::move(job);
  owner.rank = o.rank();
  return owner;
}

// ---- The bulk path ----

absl::Status ActivationService::DoReserve(grpc::ServerContext* ctx,
                                          const v1::ReserveActivationRequest& req,
                                          v1::ActivationPlacement* resp) {
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(*ctx, req.owner(), req.has_owner()));
  ASSIGN_OR_RETURN(const ActivationKey key, KeyOf(req.key(), req.has_key(), "key"));
  RETURN_IF_ERROR(CheckBytes(req.bytes(), *ctx_->activations, "bytes"));
  if (ctx_->bulk == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "this zeroshardd serves no bulk transport (", ctx_->bulk_error,
        "); offload with OffloadActivation"));
  }
  ASSIGN_OR_RETURN(SlicePlacement p,
                   ctx_->activations->Reserve(owner, key, req.bytes(), DeadlineOf(ctx)));
  resp->set_offset(p.offset);
  resp->set_bytes(p.bytes);
  resp->set_placement(p.placement);
  resp->set_lease_ms(static_cast<uint32_t>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(ctx_->activations->reservation_lease()), 1, UINT32_MAX)));
  return absl::OkStatus();
}

grpc::Status ActivationService::ReserveActivation(grpc::ServerContext* ctx,
                                                  const v1::ReserveActivationRequest* req,
                                                  v1::ActivationPlacement* resp) {
  return ctx_->Done(__func__, DoReserve(ctx, *req, resp));
}

absl::Status ActivationService::DoCommit(const grpc::ServerContext& call,
                                         const v1::CommitActivationRequest& req,
                                         v1::ActivationStored* resp) {
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(call, req.owner(), req.has_owner()));
  ASSIGN_OR_RETURN(const ActivationKey key, KeyOf(req.key(), req.has_key(), "key"));
  const std::optional<uint32_t> crc =
      req.has_crc32c() ? std::optional<uint32_t>(req.crc32c()) : std::nullopt;
  ASSIGN_OR_RETURN(uint64_t bytes, ctx_->activations->Commit(owner, key, crc));
  resp->set_bytes(bytes);
  resp->set_spilled(false);
  if (ctx_->bulk != nullptr) {
    ctx_->metrics->RecordTraffic(owner.job_id, "offload", ctx_->bulk->kind(), bytes);
  }
  return absl::OkStatus();
}

grpc::Status ActivationService::CommitActivation(grpc::ServerContext* call,
                                                 const v1::CommitActivationRequest* req,
                                                 v1::ActivationStored* resp) {
  return ctx_->Done(__func__, DoCommit(*call, *req, resp));
}

absl::Status ActivationService::DoLocate(grpc::ServerContext* ctx,
                                         const v1::LocateActivationRequest& req,
                                         v1::ActivationPlacement* resp) {
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(*ctx, req.owner(), req.has_owner()));
  ASSIGN_OR_RETURN(const ActivationKey key, KeyOf(req.key(), req.has_key(), "key"));
  if (ctx_->bulk == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "this zeroshardd serves no bulk transport (", ctx_->bulk_error,
        "); fetch with FetchActivation"));
  }
  ASSIGN_OR_RETURN(SlicePlacement p, ctx_->activations->Locate(owner, key, DeadlineOf(ctx)));
  resp->set_offset(p.offset);
  resp->set_bytes(p.bytes);
  if (p.crc32c.has_value()) resp->set_crc32c(*p.crc32c);
  resp->set_was_spilled(p.was_spilled);
  ctx_->metrics->RecordTraffic(owner.job_id, "fetch", ctx_->bulk->kind(), p.bytes);
  ctx_->activation_metrics->RecordFetch(owner.job_id, absl::Now() - start);
  return absl::OkStatus();
}

grpc::Status ActivationService::LocateActivation(grpc::ServerContext* ctx,
                                                 const v1::LocateActivationRequest* req,
                                                 v1::ActivationPlacement* resp) {
  return ctx_->Done(__func__, DoLocate(ctx, *req, resp));
}

// ---- The streaming path ----

absl::Status ActivationService::DoOffload(grpc::ServerContext* ctx,
                                          grpc::ServerReader<v1::ActivationChunk>* reader,
                                          v1::ActivationStored* resp) {
  RETURN_IF_ERROR(ctx_->CheckStreamCaller(*ctx, "OffloadActivation"));
  // A stalled stream holds its reservation until the watchdog ends it.
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(ctx);
  v1::ActivationChunk chunk;
  if (!watch->Wait([&] { return reader->Read(&chunk); })) {
    if (watch->expired()) return ctx_->IdleStreamError("OffloadActivation");
    if (ctx->IsCancelled()) return absl::CancelledError("the client abandoned the stream");
    return absl::InvalidArgumentError("the stream carried no chunk");
  }
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(*ctx, chunk.owner(), chunk.has_owner()));
  ASSIGN_OR_RETURN(const ActivationKey key,
                   KeyOf(chunk.key(), chunk.has_key(), "chunk 0.key"));
  const uint64_t total = chunk.total_bytes();
  RETURN_IF_ERROR(CheckBytes(total, *ctx_->activations, "chunk 0.total_bytes"));
  const v1::ActivationOwner first_owner = chunk.owner();
  // The slice's bytes go straight into its reserved block; the reservation
  // is dropped unless the stream ends complete and intact.
  ASSIGN_OR_RETURN(std::unique_ptr<ActivationStore::Incoming> incoming,
                   ctx_->activations->ReserveIncoming(owner, key, total, DeadlineOf(ctx)));
  uint64_t received = 0;
  uint32_t crc = 0;
  for (size_t i = 0;; ++i) {
    const std::string where = absl::StrCat("chunk ", i);
    if (i > 0) {
      if (chunk.has_owner() && (chunk.owner().job_id() != first_owner.job_id() ||
                                chunk.owner().rank() != first_owner.rank() ||
                                chunk.owner().incarnation() != first_owner.incarnation())) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".owner: differs from chunk 0's (set it on the first chunk only)"));
      }
      if (chunk.has_key() && ActivationKeyFromProto(chunk.key()) != key) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".key: differs from chunk 0's (set it on the first chunk only)"));
      }
      if (chunk.total_bytes() != 0 && chunk.total_bytes() != total) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".total_bytes: chunk 0 said ", total,
                                                       ", got ", chunk.total_bytes()));
      }
    }
    const uint64_t n = chunk.data().size();
    if (chunk.offset() != received) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".offset: expected ", received, " (chunks in order, without gaps), got ",
          chunk.offset()));
    }
    if (n == 0 || n > kMaxChunkBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".data: must be 1..", kMaxChunkBytes,
                                                     " bytes, got ", n));
    }
    if (n > total - received) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".data: ", n, " bytes at offset ",
                                                     received, " run past total_bytes ", total));
    }
    const uint32_t chunk_crc = Crc32c(chunk.data().data(), n);
    if (chunk_crc != chunk.crc32c()) {
      return absl::DataLossError(absl::StrCat(
          where, ": CRC-32C of the data does not match (corrupted in transit); nothing is stored"));
    }
    std::memcpy(incoming->data() + received, chunk.data().data(), n);
    crc = Crc32cCombine(crc, chunk_crc, n);
    received += n;
    chunk.Clear();
    if (!watch->Wait([&] { return reader->Read(&chunk); })) break;
  }
  if (watch->expired()) return ctx_->IdleStreamError("OffloadActivation");
  if (ctx->IsCancelled()) {
    return absl::CancelledError("the client abandoned the stream; nothing is stored");
  }
  if (received != total) {
    return absl::InvalidArgumentError(absl::StrCat("the stream carried ", received,
                                                   " bytes of total_bytes ", total,
                                                   "; nothing is stored"));
  }
  RETURN_IF_ERROR(incoming->Commit(crc));
  resp->set_bytes(total);
  resp->set_spilled(false);
  ctx_->metrics->RecordTraffic(owner.job_id, "offload", "stream", total);
  return absl::OkStatus();
}

grpc::Status ActivationService::OffloadActivation(grpc::ServerContext* ctx,
                                                  grpc::ServerReader<v1::ActivationChunk>* reader,
                                                  v1::ActivationStored* resp) {
  return ctx_->Done(__func__, DoOffload(ctx, reader, resp));
}

absl::Status ActivationService::DoFetch(grpc::ServerContext* ctx,
                                        const v1::FetchActivationRequest& req,
                                        grpc::ServerWriter<v1::ActivationChunk>* writer) {
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(*ctx, req.owner(), req.has_owner()));
  ASSIGN_OR_RETURN(const ActivationKey key, KeyOf(req.key(), req.has_key(), "key"));
  if (req.max_chunk_bytes() != 0 && (req.max_chunk_bytes() < kMinActivationChunkBytes ||
                                     req.max_chunk_bytes() > kMaxChunkBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_bytes: must be 0 (the daemon's default) or ", kMinActivationChunkBytes, "..",
        kMaxChunkBytes, ", got ", req.max_chunk_bytes()));
  }
  const uint64_t chunk_bytes = req.max_chunk_bytes() != 0 ? req.max_chunk_bytes() : ctx_->max_chunk_bytes;
  uint64_t sent = 0;
  // Each piece is written from the arena with no lock held; the store keeps
  // the slice in place until the last is written (or the watchdog ends a
  // stalled reader's call).
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(ctx);
  absl::Status s = ctx_->activations->Fetch(
      owner, key, DeadlineOf(ctx), chunk_bytes,
      [&](const SlicePlacement& slice, uint64_t offset, absl::string_view data) {
        v1::ActivationChunk c;
        if (offset == 0) {
          *c.mutable_key() = req.key();
          c.set_total_bytes(slice.bytes);
        }
        c.set_offset(offset);
        c.set_data(data.data(), data.size());
        c.set_crc32c(Crc32c(data.data(), data.size()));
        sent += data.size();
        return watch->Wait([&] { return writer->Write(c); });
      });
  if (watch->expired()) s = ctx_->IdleStreamError("FetchActivation");
  ctx_->metrics->RecordTraffic(owner.job_id, "fetch", "stream", sent);
  if (s.ok()) ctx_->activation_metrics->RecordFetch(owner.job_id, absl::Now() - start);
  return s;
}

grpc::Status ActivationService::FetchActivation(grpc::ServerContext* ctx,
                                                const v1::FetchActivationRequest* req,
                                                grpc::ServerWriter<v1::ActivationChunk>* writer) {
  return ctx_->Done(__func__, DoFetch(ctx, *req, writer));
}

// ---- Both paths ----

absl::Status ActivationService::DoPrefetch(grpc::ServerContext* ctx,
                                           const v1::PrefetchActivationsRequest& req,
                                           v1::PrefetchActivationsResponse* resp) {
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(*ctx, req.owner(), req.has_owner()));
  if (req.keys_size() > kMaxPrefetchKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: at most ", kMaxPrefetchKeys, ", got ", req.keys_size()));
  }
  std::vector<ActivationKey> keys;
  keys.reserve(req.keys_size());
  for (int i = 0; i < req.keys_size(); ++i) {
    ASSIGN_OR_RETURN(const ActivationKey key,
                     ParseActivationKey(req.keys(i), absl::StrCat("keys[", i, "]")));
    keys.push_back(key);
  }
  ASSIGN_OR_RETURN(uint32_t started, ctx_->activations->Prefetch(owner, keys, DeadlineOf(ctx)));
  resp->set_started(started);
  return absl::OkStatus();
}

grpc::Status ActivationService::PrefetchActivations(grpc::ServerContext* ctx,
                                                    const v1::PrefetchActivationsRequest* req,
                                                    v1::PrefetchActivationsResponse* resp) {
  return ctx_->Done(__func__, DoPrefetch(ctx, *req, resp));
}

absl::Status ActivationService::DoFree(const grpc::ServerContext& call,
                                       const v1::FreeActivationsRequest& req,
                                       v1::FreeActivationsResponse* resp) {
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(SliceOwner owner, Owner(call, req.owner(), req.has_owner()));
  ActivationStore::Freed freed;
  if (req.has_if_placement()) {
    if (req.whole_step() || !req.has_key()) {
      return absl::InvalidArgumentError(
          "if_placement: ends the fetch of one key; set key and leave whole_step unset");
    }
    if (req.if_placement() == 0) {
      return absl::InvalidArgumentError(
          "if_placement: 0 names no reservation; send the placement ReserveActivation answered");
    }
    ASSIGN_OR_RETURN(const ActivationKey key, ParseActivationKey(req.key(), "key"));
    if (ctx_->bulk == nullptr) {
      return absl::UnavailableError(absl::StrCat("this zeroshardd serves no bulk transport (",
                                                 ctx_->bulk_error, "); free without if_placement"));
    }
    ASSIGN_OR_RETURN(
        std::optional<ActivationStore::Freed> released,
        ctx_->activations->ReleaseFetched(owner, key, req.if_placement()));
    if (!released.has_value()) {
      resp->set_moved(true);
      return absl::OkStatus();
    }
    freed = *released;
    // The daemon's part of this fetch: a Get needs none of its time.
    ctx_->metrics->RecordTraffic(owner.job_id, "fetch", ctx_->bulk->kind(), freed.bytes);
    ctx_->activation_metrics->RecordFetch(owner.job_id, absl::Now() - start);
  } else if (req.whole_step()) {
    if (!req.has_key()) {
      return absl::InvalidArgumentError("key: whole_step frees the step of key.step; set key");
    }
    ASSIGN_OR_RETURN(freed, ctx_->activations->FreeStep(owner, req.key().step()));
  } else if (req.has_key()) {
    ASSIGN_OR_RETURN(const ActivationKey key, ParseActivationKey(req.key(), "key"));
    ASSIGN_OR_RETURN(freed, ctx_->activations->FreeKey(owner, key));
  } else {
    ASSIGN_OR_RETURN(freed, ctx_->activations->FreeAll(owner));
  }
  resp->set_freed(freed.slices);
  resp->set_bytes(freed.bytes);
  return absl::OkStatus();
}

grpc::Status ActivationService::FreeActivations(grpc::ServerContext* call,
                                                const v1::FreeActivationsRequest* req,
                                                v1::FreeActivationsResponse* resp) {
  return ctx_->Done(__func__, DoFree(*call, *req, resp));
}

}  // namespace zeroshard
