#include "server/testing/activation_testing.h"

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/channel.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace zeroshard::testing {
namespace {

void SetDeadline(grpc::ClientContext* ctx, int seconds = 60) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

}  // namespace

v1::ActivationOwner MakeOwner(const std::string& job, uint32_t rank, uint64_t incarnation) {
  v1::ActivationOwner o;
  o.set_job_id(job);
  o.set_rank(rank);
  o.set_incarnation(incarnation);
  return o;
}

v1::ActivationKey MakeKey(uint64_t step, uint32_t layer, uint32_t micro_batch, uint32_t mp_rank,
                          uint32_t mp_size) {
  v1::ActivationKey k;
  k.set_step(step);
  k.set_layer(layer);
  k.set_micro_batch(micro_batch);
  k.set_mp_rank(mp_rank);
  k.set_mp_size(mp_size);
  return k;
}

ActivationClient::ActivationClient(const std::string& address, const std::string& token) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  channel = MakeChannel(address, ChannelSecurity::Plaintext(token), args);
  stub = v1::Activation::NewStub(channel);
}

grpc::Status ActivationClient::Reserve(const v1::ActivationOwner& owner,
                                       const v1::ActivationKey& key, uint64_t bytes,
                                       v1::ActivationPlacement* placement) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ReserveActivationRequest req;
  *req.mutable_owner() = owner;
  *req.mutable_key() = key;
  req.set_bytes(bytes);
  v1::ActivationPlacement local;
  return stub->ReserveActivation(&ctx, req, placement != nullptr ? placement : &local);
}

grpc::Status ActivationClient::Commit(const v1::ActivationOwner& owner,
                                      const v1::ActivationKey& key, std::optional<uint32_t> crc32c,
                                      v1::ActivationStored* stored) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::CommitActivationRequest req;
  *req.mutable_owner() = owner;
  *req.mutable_key() = key;
  if (crc32c.has_value()) req.set_crc32c(*crc32c);
  v1::ActivationStored local;
  return stub->CommitActivation(&ctx, req, stored != nullptr ? stored : &local);
}

grpc::Status ActivationClient::Locate(const v1::ActivationOwner& owner,
                                      const v1::ActivationKey& key,
                                      v1::ActivationPlacement* placement) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::LocateActivationRequest req;
  *req.mutable_owner() = owner;
  *req.mutable_key() = key;
  return stub->LocateActivation(&ctx, req, placement);
}

grpc::Status ActivationClient::Offload(
    const v1::ActivationOwner& owner, const v1::ActivationKey& key, const std::string& bytes,
    uint64_t chunk_bytes, const std::function<void(size_t, v1::ActivationChunk*)>& edit,
    v1::ActivationStored* stored) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ActivationStored local;
  auto writer = stub->OffloadActivation(&ctx, stored != nullptr ? stored : &local);
  size_t i = 0;
  for (uint64_t off = 0; off < bytes.size() || (off == 0 && bytes.empty()); off += chunk_bytes, ++i) {
    v1::ActivationChunk c;
    if (i == 0) {
      *c.mutable_owner() = owner;
      *c.mutable_key() = key;
      c.set_total_bytes(bytes.size());
    }
    const uint64_t n = std::min<uint64_t>(chunk_bytes, bytes.size() - off);
    c.set_offset(off);
    c.set_data(bytes.data() + off, n);
    c.set_crc32c(Crc32c(bytes.data() + off, n));
    if (edit) edit(i, &c);
    if (!writer->Write(c)) break;
    if (bytes.empty()) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status ActivationClient::Fetch(const v1::ActivationOwner& owner,
                                     const v1::ActivationKey& key, std::string* out,
                                     uint64_t max_chunk_bytes) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::FetchActivationRequest req;
  *req.mutable_owner() = owner;
  *req.mutable_key() = key;
  req.set_max_chunk_bytes(max_chunk_bytes);
  auto reader = stub->FetchActivation(&ctx, req);
  out->clear();
  v1::ActivationChunk c;
  uint64_t total = 0;
  while (reader->Read(&c)) {
    if (out->empty()) total = c.total_bytes();
    EXPECT_EQ(c.offset(), out->size());
    EXPECT_EQ(Crc32c(c.data().data(), c.data().size()), c.crc32c());
    out->append(c.data());
  }
  grpc::Status s = reader->Finish();
  if (s.ok()) EXPECT_EQ(out->size(), total);
  return s;
}

grpc::Status ActivationClient::Prefetch(const v1::ActivationOwner& owner,
                                        const std::vector<v1::ActivationKey>& keys,
                                        uint32_t* started) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::PrefetchActivationsRequest req;
  *req.mutable_owner() = owner;
  for (const auto& k : keys) *req.add_keys() = k;
  v1::PrefetchActivationsResponse resp;
  grpc::Status s = stub->PrefetchActivations(&ctx, req, &resp);
  if (started != nullptr) *started = resp.started();
  return s;
}

grpc::Status ActivationClient::Free(const v1::ActivationOwner& owner, const v1::ActivationKey* key,
                                    bool whole_step, v1::FreeActivationsResponse* response,
                                    std::optional<uint64_t> if_placement) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::FreeActivationsRequest req;
  *req.mutable_owner() = owner;
  if (key != nullptr) *req.mutable_key() = *key;
  req.set_whole_step(whole_step);
  if (if_placement.has_value()) req.set_if_placement(*if_placement);
  v1::FreeActivationsResponse local;
  return stub->FreeActivations(&ctx, req, response != nullptr ? response : &local);
}

void ExpectActivationRejected(Daemon& daemon, const std::string& job, grpc::StatusCode code,
                              const std::string& text, const std::function<grpc::Status()>& call) {
  const auto ledger = daemon.ledger().Snapshot();
  const uint64_t store = daemon.activations() != nullptr ? daemon.activations()->StateHash() : 0;
  ExpectRejected(daemon, job, code, text, call);
  EXPECT_EQ(daemon.ledger().Snapshot(), ledger) << "a ledger entry changed: " << text;
  if (daemon.activations() != nullptr) {
    EXPECT_EQ(daemon.activations()->StateHash(), store) << "the store changed: " << text;
  }
}

double MetricValue(const Daemon& daemon, const std::string& series) {
  const std::string text = prometheus::TextSerializer().Serialize(daemon.registry().Collect());
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, series + " ")) {
      double v = 0;
      EXPECT_TRUE(absl::SimpleAtod(line.substr(series.size() + 1), &v)) << line;
      return v;
    }
  }
  return 0;
}

}  // namespace zeroshard::testing
