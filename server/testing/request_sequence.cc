#include "server/testing/request_sequence.h"

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/protocol.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/checkpoint.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "server/rpc/job_wire.h"
#include "transport/transport.h"

namespace zeroshard::testing {
namespace {

struct RpcInfo {
  const char* name;
  bool client_streaming;
};

// In the order of Rpc.
constexpr RpcInfo kRpcs[kNumRpcs] = {
    {"Control.RegisterJob", false},
    {"Control.JoinJob", false},
    {"Control.GetPartitionMap", false},
    {"Control.Heartbeat", false},
    {"Control.Leave", false},
    {"Shard.InitParameters", true},
    {"Shard.PushGradient", true},
    {"Shard.Gather", false},
    {"Shard.PrepareStep", false},
    {"Shard.CommitStep", false},
    {"Shard.GetStepState", false},
    {"Shard.ExchangeEndpoint", false},
    {"Shard.FenceStagingSlot", false},
    {"Admin.MemoryReport", false},
    {"Admin.Status", false},
    {"Admin.Estimate", false},
    {"Checkpoint.SaveCheckpoint", false},
    {"Checkpoint.GetCheckpointStatus", false},
    {"Checkpoint.CompleteCheckpoint", false},
    {"Checkpoint.LoadCheckpoint", false},
    {"Checkpoint.ListCheckpoints", false},
    {"Checkpoint.VerifyCheckpoint", false},
    {"Activation.ReserveActivation", false},
    {"Activation.CommitActivation", false},
    {"Activation.OffloadActivation", true},
    {"Activation.LocateActivation", false},
    {"Activation.FetchActivation", false},
    {"Activation.PrefetchActivations", false},
    {"Activation.FreeActivations", false},
    {"Shard.ReadState", false},
    {"Shard.WriteState", true},
    {"Replica.GetReplicaState", false},
    {"Replica.Promote", false},
    {"Replica.TransferState", true},
    {"Replica.ForwardGradient", true},
    {"Replica.CommitReplica", false},
    {"Replica.ReleaseReplica", false},
    {"Shard.MapPushMemory", false},
};

// ---------------------------------------------------------------------------
// Fixups.

// The replicated job's backup copy (kReplicaBackupGroup) as the call
// finds it; `present` false once it was released (the fixes then use its
// first epoch and step).
struct BackupCopy {
  bool present = false;
  uint64_t epoch = 1;
  uint64_t committed = 0;
  FlatRange owned;  // its owned unpadded range
};

// What the fixups of one call need to know.
struct Fixer {
  uint8_t fixups = 0;
  const v1::JobSpec* live = nullptr;
  const Layout* layout = nullptr;  // the live job's
  uint64_t committed = 0;          // the live job's committed step
  uint32_t max_wait_ms = 100;
  const v1::PartManifest* last_part = nullptr;  // may be null
  BackupCopy backup;
  const transport::PushMemory* push_memory = nullptr;
  uint32_t push_memory_id = 0;  // what the last MapPushMemory answered (0: none)

  bool on(Fixup f) const { return (fixups & f) != 0; }
  void Job(std::string* id) const {
    if (on(kLiveJob)) *id = live->job_id();
  }
  uint32_t Rank(uint32_t rank) const { return on(kLiveRank) ? rank % live->world_size() : rank; }
  uint64_t Incarnation(uint64_t incarnation) const {
    return on(kLiveRank) ? kTestIncarnation : incarnation;
  }
  // Valid waits are kept short; invalid ones are kept, to be refused.
  uint32_t Wait(uint32_t ms) const { return ms > kMaxWaitMs ? ms : ms % (max_wait_ms + 1); }
  uint64_t NextStep(uint64_t step) const { return on(kLiveStep) ? committed + 1 : step; }
  uint64_t CommittedStep(uint64_t step) const { return on(kLiveStep) ? committed : step; }
  // The Replica RPCs' fields (see Fixup).
  void ReplicaJob(std::string* id) const {
    if (on(kLiveJob)) *id = kReplicaJobId;
  }
  template <typename Request>
  void GroupAndEpoch(Request* r) const {
    if (!on(kLiveRank)) return;
    r->set_group(kReplicaBackupGroup);
    r->set_epoch(backup.epoch);
  }
};

// `data` repeated (zeros when empty) to `bytes` bytes.
std::string Tile(const std::string& data, uint64_t bytes) {
  if (data.empty()) return std::string(bytes, '\0');
  std::string out;
  out.reserve(bytes);
  while (out.size() < bytes)
    out.append(data, 0, std::min<uint64_t>(data.size(), bytes - out.size()));
  return out;
}

uint64_t WireDTypeSize(int dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return 4;
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    default:
      return 0;
  }
}

// Fits `data` to the elements of `range` in `dtype` (see kFitData).
void FitData(const v1::FlatRange& range, int dtype, std::string* data) {
  const uint64_t size = WireDTypeSize(dtype);
  if (size == 0 || range.end() <= range.begin()) return;
  const uint64_t elements = range.end() - range.begin();
  if (elements > kMaxFittedBytes / size) return;
  *data = Tile(*data, elements * size);
}

// Zeroes what a WriteState chunk of `array` over `range` of `layout` must
// hold as zeros: alignment gaps, and the moments of frozen tensors.
void ZeroStateGaps(const Layout& layout, int array, const v1::FlatRange& range, std::string* data) {
  const FlatRange r{range.begin(), range.end()};
  if (r.empty() || r.size() > kMaxFittedBytes / sizeof(float) ||
      data->size() != r.size() * sizeof(float)) {
    return;
  }
  auto zero = [&](uint64_t begin, uint64_t end) {
    if (end <= begin) return;
    std::memset(data->data() + (begin - r.begin) * sizeof(float), 0, (end - begin) * sizeof(float));
  };
  const bool moments = array != v1::STATE_ARRAY_MASTER;
  uint64_t pos = r.begin;
  const auto [first, last] = layout.TensorsIn(r);
  for (size_t i = first; i < last; ++i) {
    const TensorPlacement& t = layout.tensors()[i];
    const FlatRange in = t.range().Intersect(r);
    if (in.empty()) continue;
    zero(pos, in.begin);
    if (moments && t.spec.frozen) zero(in.begin, in.end);
    pos = std::max(pos, in.end);
  }
  zero(pos, r.end);
}

void Fix(const Fixer& f, v1::ActivationOwner* owner) {
  f.Job(owner->mutable_job_id());
  owner->set_rank(f.Rank(owner->rank()));
  owner->set_incarnation(f.Incarnation(owner->incarnation()));
}

// An owner is added when there is none and the job or rank is fixed up.
template <typename Request>
void FixOwner(const Fixer& f, Request* r) {
  if (f.on(kLiveJob) || f.on(kLiveRank)) Fix(f, r->mutable_owner());
}

void Fix(const Fixer& f, v1::RegisterJobRequest* r) {
  f.Job(r->mutable_spec()->mutable_job_id());
  if (f.on(kChecksums)) {
    absl::StatusOr<Layout> layout = LayoutFromProto(r->spec().layout());
    if (layout.ok()) r->mutable_spec()->set_layout_fingerprint(layout->fingerprint());
  }
}
void Fix(const Fixer& f, v1::JoinJobRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
  if (f.on(kLiveRank)) {
    r->set_layout_fingerprint(f.live->layout_fingerprint());
    r->set_stage(f.live->stage());
    r->set_world_size(f.live->world_size());
    r->set_precision(f.live->precision());
  }
}
void Fix(const Fixer& f, v1::GetPartitionMapRequest* r) { f.Job(r->mutable_job_id()); }
void Fix(const Fixer& f, v1::HeartbeatRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
}
void Fix(const Fixer& f, v1::LeaveRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
}
void Fix(const Fixer& f, v1::ParameterChunk* c) {
  // Later chunks of a stream may leave the job id out.
  if (!c->job_id().empty()) f.Job(c->mutable_job_id());
  c->set_rank(f.Rank(c->rank()));
  if (f.on(kFitData)) FitData(c->range(), c->dtype(), c->mutable_data());
  if (f.on(kChecksums)) c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
}
void Fix(const Fixer& f, v1::GradientChunk* c) {
  if (!c->job_id().empty()) f.Job(c->mutable_job_id());
  c->set_rank(f.Rank(c->rank()));
  c->set_incarnation(f.Incarnation(c->incarnation()));
  c->set_step(f.NextStep(c->step()));
  if (f.on(kLiveRank) && c->push_memory() != 0 && f.push_memory_id != 0) {
    c->set_push_memory(f.push_memory_id);
  }
  if (f.on(kFitData) && !c->staged()) FitData(c->range(), c->dtype(), c->mutable_data());
  if (f.on(kChecksums)) c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
}
void Fix(const Fixer& f, v1::GatherRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_after_step(f.CommittedStep(r->after_step()));
  r->set_wait_ms(f.Wait(r->wait_ms()));
}
void Fix(const Fixer& f, v1::PrepareStepRequest* r) {
  f.Job(r->mutable_job_id());
  if (f.on(kLiveRank)) r->set_rank(0);
  r->set_incarnation(f.Incarnation(r->incarnation()));
  r->set_step(f.NextStep(r->step()));
}
void Fix(const Fixer& f, v1::CommitStepRequest* r) {
  f.Job(r->mutable_job_id());
  if (f.on(kLiveRank)) r->set_rank(0);
  r->set_incarnation(f.Incarnation(r->incarnation()));
  r->set_step(f.NextStep(r->step()));
}
void Fix(const Fixer& f, v1::GetStepStateRequest* r) { f.Job(r->mutable_job_id()); }
void Fix(const Fixer& f, v1::ExchangeEndpointRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
}
void Fix(const Fixer& f, v1::FenceStagingSlotRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
}
void Fix(const Fixer& f, v1::MapPushMemoryRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
  if (f.on(kLiveRank) && f.push_memory != nullptr) {
    r->set_pid(f.push_memory->pid());
    r->set_fd(f.push_memory->fd());
    r->set_name(f.push_memory->name());
  }
}
void Fix(const Fixer& f, v1::ReadStateRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_rank(f.Rank(r->rank()));
  r->set_incarnation(f.Incarnation(r->incarnation()));
}
void Fix(const Fixer& f, v1::StateChunk* c) {
  // Later chunks of a stream may leave the job id out.
  if (!c->job_id().empty()) f.Job(c->mutable_job_id());
  c->set_rank(f.Rank(c->rank()));
  c->set_incarnation(f.Incarnation(c->incarnation()));
  if (f.on(kFitData)) {
    FitData(c->range(), v1::DTYPE_FP32, c->mutable_data());
    ZeroStateGaps(*f.layout, c->array(), c->range(), c->mutable_data());
  }
  if (f.on(kChecksums)) c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
}
void Fix(const Fixer& f, v1::MemoryReportRequest* r) { f.Job(r->mutable_job_id()); }
void Fix(const Fixer&, v1::StatusRequest*) {}
void Fix(const Fixer&, v1::EstimateRequest*) {}
void Fix(const Fixer& f, v1::SaveCheckpointRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_step(f.CommittedStep(r->step()));
}
void Fix(const Fixer& f, v1::GetCheckpointStatusRequest* r) {
  f.Job(r->mutable_job_id());
  r->set_wait_ms(f.Wait(r->wait_ms()));
}
void Fix(const Fixer& f, v1::CompleteCheckpointRequest* r) {
  f.Job(r->mutable_job_id());
  if (f.on(kLastPart) && f.last_part != nullptr) {
    r->clear_parts();
    *r->add_parts() = *f.last_part;
  }
}
void Fix(const Fixer& f, v1::LoadCheckpointRequest* r) { f.Job(r->mutable_job_id()); }
void Fix(const Fixer& f, v1::ListCheckpointsRequest* r) { f.Job(r->mutable_job_id()); }
void Fix(const Fixer& f, v1::VerifyCheckpointRequest* r) { f.Job(r->mutable_job_id()); }
void Fix(const Fixer& f, v1::ReserveActivationRequest* r) { FixOwner(f, r); }
void Fix(const Fixer& f, v1::CommitActivationRequest* r) { FixOwner(f, r); }
void Fix(const Fixer& f, v1::LocateActivationRequest* r) { FixOwner(f, r); }
void Fix(const Fixer& f, v1::FetchActivationRequest* r) { FixOwner(f, r); }
void Fix(const Fixer& f, v1::PrefetchActivationsRequest* r) { FixOwner(f, r); }
void Fix(const Fixer& f, v1::FreeActivationsRequest* r) { FixOwner(f, r); }
void Fix(const Fixer& f, v1::ActivationChunk* c) {
  // Only the first chunk of an offload names its owner.
  if (c->has_owner()) Fix(f, c->mutable_owner());
  if (f.on(kChecksums)) c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
}

void Fix(const Fixer& f, v1::GetReplicaStateRequest* r) { f.ReplicaJob(r->mutable_job_id()); }
void Fix(const Fixer& f, v1::PromoteRequest* r) {
  f.ReplicaJob(r->mutable_job_id());
  f.GroupAndEpoch(r);
  if (f.on(kLiveRank)) r->set_epoch(f.backup.epoch + 1);
  if (f.on(kLiveStep)) r->set_committed_step(f.backup.committed);
}
void Fix(const Fixer& f, v1::ReplicaStateChunk* c) {
  // Later chunks of a stream may leave the job id out.
  if (!c->job_id().empty()) f.ReplicaJob(c->mutable_job_id());
  f.GroupAndEpoch(c);
  if (f.on(kLiveStep) && c->has_state()) c->mutable_state()->set_committed_step(f.backup.committed);
  if (f.on(kChecksums)) c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
}
void Fix(const Fixer& f, v1::ForwardedGradientChunk* c) {
  if (!c->job_id().empty()) f.ReplicaJob(c->mutable_job_id());
  f.GroupAndEpoch(c);
  if (f.on(kLiveStep)) c->set_step(f.backup.committed + 1);
  if (f.on(kChecksums)) c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
}
void Fix(const Fixer& f, v1::CommitReplicaRequest* r) {
  f.ReplicaJob(r->mutable_job_id());
  f.GroupAndEpoch(r);
  if (f.on(kLiveJob)) r->mutable_commit()->set_job_id(kReplicaJobId);
  if (f.on(kLiveStep)) r->mutable_commit()->set_step(f.backup.committed + 1);
}
void Fix(const Fixer& f, v1::ReleaseReplicaRequest* r) {
  f.ReplicaJob(r->mutable_job_id());
  f.GroupAndEpoch(r);
}

// kFitData for a TransferState: each chunk continues its array from where
// the stream's earlier chunks left it, the last chunk of an array filling
// it to the backup copy's range (fp32 arrays of that many elements).
void FitTransferStream(const Fixer& f, std::vector<v1::ReplicaStateChunk>* chunks) {
  const uint64_t n = f.backup.owned.size();
  if (!f.backup.present || n == 0 || n > kMaxFittedBytes / sizeof(float)) return;
  std::map<uint32_t, uint64_t> filled;  // by array
  for (size_t i = 0; i < chunks->size(); ++i) {
    v1::ReplicaStateChunk& c = (*chunks)[i];
    if (c.has_bulk()) continue;
    bool last = true;
    for (size_t j = i + 1; j < chunks->size(); ++j) {
      if ((*chunks)[j].array() == c.array()) last = false;
    }
    uint64_t& offset = filled[c.array()];
    const uint64_t count =
        last ? n - offset : std::min<uint64_t>(c.data().size() / sizeof(float), n - offset);
    c.set_offset(offset);
    *c.mutable_data() = Tile(c.data(), count * sizeof(float));
    offset += count;
  }
}

// kFitData for a ForwardGradient: the chunks cover the backup copy's range
// back to back (each keeping its length where it fits), the last to its
// end.
void FitForwardStream(const Fixer& f, std::vector<v1::ForwardedGradientChunk>* chunks) {
  const FlatRange owned = f.backup.owned;
  if (!f.backup.present || owned.empty() || owned.size() > kMaxFittedBytes / sizeof(float)) {
    return;
  }
  uint64_t pos = owned.begin;
  for (size_t i = 0; i < chunks->size(); ++i) {
    v1::ForwardedGradientChunk& c = (*chunks)[i];
    const uint64_t length =
        c.range().end() > c.range().begin() ? c.range().end() - c.range().begin() : 0;
    const uint64_t end =
        i + 1 == chunks->size() || length == 0 || length > owned.end - pos ? owned.end
                                                                            : pos + length;
    c.mutable_range()->set_begin(pos);
    c.mutable_range()->set_end(end);
    *c.mutable_data() = Tile(c.data(), (end - pos) * sizeof(float));
    pos = end;
  }
}

// Tiles each chunk's data to where the next chunk starts (the last: to the
// slice's total_bytes, which the first chunk gives).
void FitActivationStream(std::vector<v1::ActivationChunk>* chunks) {
  if (chunks->empty()) return;
  const uint64_t total = (*chunks)[0].total_bytes();
  for (size_t i = 0; i < chunks->size(); ++i) {
    v1::ActivationChunk& c = (*chunks)[i];
    uint64_t end = total;
    if (i + 1 < chunks->size() && (*chunks)[i + 1].offset() > c.offset()) {
      end = (*chunks)[i + 1].offset();
    }
    if (end <= c.offset() || end - c.offset() > kMaxFittedBytes) continue;
    *c.mutable_data() = Tile(c.data(), end - c.offset());
  }
}

grpc::Status Unparsable(const Call& call) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat(RpcName(call.rpc), ": a message does not parse; not sent"));
}

template <typename Request>
bool Parse(const Call& call, const Fixer& f, Request* request) {
  if (call.messages.empty() || !request->ParseFromString(call.messages[0])) return false;
  Fix(f, request);
  return true;
}

template <typename Chunk>
bool ParseStream(const Call& call, const Fixer& f, std::vector<Chunk>* chunks) {
  for (const std::string& m : call.messages) {
    Chunk c;
    if (!c.ParseFromString(m)) return false;
    chunks->push_back(std::move(c));
  }
  if constexpr (std::is_same_v<Chunk, v1::ActivationChunk>) {
    if (f.on(kFitData)) FitActivationStream(chunks);
  }
  if constexpr (std::is_same_v<Chunk, v1::ReplicaStateChunk>) {
    if (f.on(kFitData)) FitTransferStream(f, chunks);
  }
  if constexpr (std::is_same_v<Chunk, v1::ForwardedGradientChunk>) {
    if (f.on(kFitData)) FitForwardStream(f, chunks);
  }
  for (Chunk& c : *chunks) Fix(f, &c);
  return true;
}

// Sends `chunks` on a client stream opened by `open` and finishes it.
template <typename Chunk, typename Open>
grpc::Status SendStream(grpc::ClientContext* ctx, const std::vector<Chunk>& chunks, Open open) {
  auto writer = open(ctx);
  for (const Chunk& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// Reads a server stream to its end and finishes it.
template <typename Response, typename Reader>
grpc::Status ReadAll(Reader reader) {
  Response r;
  while (reader->Read(&r)) {
  }
  return reader->Finish();
}

// Values for the live job's parameters: small, varied, deterministic.
std::vector<float> LiveParameters(uint64_t n) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = 0.02f * std::sin(0.37f * static_cast<float>(i));
  return v;
}

std::string TempDirectory() {
  const char* tmp = getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/zs-requests.XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "";
  return pattern;
}

}  // namespace

const char* RpcName(Rpc rpc) { return kRpcs[static_cast<int>(rpc)].name; }
bool IsClientStreaming(Rpc rpc) { return kRpcs[static_cast<int>(rpc)].client_streaming; }

// ---------------------------------------------------------------------------
// The byte format.

std::vector<Call> DecodeSequence(absl::string_view bytes) {
  std::vector<Call> calls;
  size_t p = 0;
  auto take = [&](size_t n) {
    absl::string_view out = bytes.substr(p, n);
    p += out.size();
    return out;
  };
  auto message = [&] {
    absl::string_view length = take(2);
    size_t n = length.empty() ? 0 : static_cast<uint8_t>(length[0]);
    if (length.size() == 2) n |= static_cast<size_t>(static_cast<uint8_t>(length[1])) << 8;
    return std::string(take(n));
  };
  while (calls.size() < kMaxCalls && bytes.size() - p >= 2) {
    Call call;
    call.rpc = static_cast<Rpc>(static_cast<uint8_t>(bytes[p]) % kNumRpcs);
    call.fixups = static_cast<uint8_t>(bytes[p + 1]);
    p += 2;
    if (IsClientStreaming(call.rpc)) {
      absl::string_view count = take(1);
      const size_t n =
          count.empty() ? 0 : static_cast<uint8_t>(count[0]) % (kMaxStreamMessages + 1);
      for (size_t i = 0; i < n && p < bytes.size(); ++i) call.messages.push_back(message());
    } else {
      call.messages.push_back(message());
    }
    calls.push_back(std::move(call));
  }
  return calls;
}

std::string EncodeSequence(const std::vector<Call>& calls) {
  std::string out;
  for (size_t i = 0; i < calls.size() && i < kMaxCalls; ++i) {
    const Call& call = calls[i];
    out.push_back(static_cast<char>(call.rpc));
    out.push_back(static_cast<char>(call.fixups));
    size_t n = call.messages.size();
    if (IsClientStreaming(call.rpc)) {
      n = std::min(n, kMaxStreamMessages);
      out.push_back(static_cast<char>(n));
    } else {
      n = std::min<size_t>(n, 1);
    }
    for (size_t m = 0; m < n; ++m) {
      const std::string& bytes = call.messages[m];
      const size_t length = std::min<size_t>(bytes.size(), 0xffff);
      out.push_back(static_cast<char>(length & 0xff));
      out.push_back(static_cast<char>(length >> 8));
      out.append(bytes, 0, length);
    }
    if (!IsClientStreaming(call.rpc) && n == 0) out.append(2, '\0');
  }
  return out;
}

// ---------------------------------------------------------------------------
// The world.

v1::JobSpec LiveJobSpec(const std::string& address) {
  return MakeSpec(kLiveJobId, SampleLayout(), kLiveStage, kLiveWorldSize, {address});
}

v1::JobSpec ReplicaJobSpec(const std::string& address) {
  v1::JobSpec spec = MakeSpec(kReplicaJobId, SampleLayout(), kLiveStage, kLiveWorldSize,
                              {address, kReplicaPeerAddress});
  spec.set_replicas(2);
  return spec;
}

RequestWorld::RequestWorld(const Options& options, std::string dir)
    : options_(options), dir_(std::move(dir)) {}

RequestWorld::~RequestWorld() {
  live_.reset();
  arena_connection_.reset();
  peer_.reset();
  activation_.reset();
  replica_.reset();
  client_.reset();
  daemon_.reset();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

absl::StatusOr<std::unique_ptr<RequestWorld>> RequestWorld::Create(const Options& options) {
  std::string dir = TempDirectory();
  if (dir.empty()) return absl::InternalError("cannot create a temporary directory");
  std::unique_ptr<RequestWorld> w(new RequestWorld(options, std::move(dir)));
  absl::StatusOr<std::unique_ptr<transport::PushMemory>> memory =
      transport::PushMemory::Create(1 << 20);
  if (!memory.ok()) return memory.status();
  w->push_memory_ = *std::move(memory);
  DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.memory_limit_bytes = options.memory_limit_bytes;
  o.bulk_transport = "inproc";
  o.checkpoint_dir = w->dir_ + "/checkpoints";
  o.activation_arena_bytes = options.activation_arena_bytes;
  o.spill_dir = w->dir_ + "/spill";
  o.spill_bytes = options.spill_bytes;
  // Removed jobs are freed at once, so Restore finds the ledger settled.
  o.read_lease = absl::ZeroDuration();
  // Small enough that pushes out of order can run out of it.
  o.reduction_buffer_bytes = 1 << 20;
  // The replicated job is never joined: it stays until Restore removes it.
  o.join_timeout = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(o);
  if (!daemon.ok()) {
    // Without io_uring (some sandboxes) the arena works without spilling.
    o.spill_dir.clear();
    daemon = Daemon::Start(o);
  }
  if (!daemon.ok()) return daemon.status();
  w->daemon_ = *std::move(daemon);
  w->client_ = std::make_unique<DaemonClient>(w->daemon_->address());
  w->activation_ = v1::Activation::NewStub(w->client_->channel);
  w->replica_ = v1::Replica::NewStub(w->client_->channel);
  w->empty_ledger_bytes_ = w->daemon_->ledger().total();
  if (ActivationStore* store = w->daemon_->activations();
      store != nullptr && w->daemon_->bulk_transport() != nullptr) {
    // The world plays the arena's tenant: a key of its own, as a job whose
    // rank exchanged endpoints would get.
    if (absl::Status s = store->IssueTenantKey(); !s.ok()) return s;
    v1::ExchangeEndpointResponse regions;
    store->FillRegion(&regions);
    absl::StatusOr<std::unique_ptr<transport::Transport>> peer =
        transport::CreateTransport("inproc");
    if (!peer.ok()) return peer.status();
    w->peer_ = *std::move(peer);
    absl::StatusOr<std::unique_ptr<transport::Connection>> connection = w->peer_->Connect(
        w->daemon_->bulk_transport()->LocalAddress(), absl::Now() + absl::Seconds(10));
    if (!connection.ok()) return connection.status();
    w->arena_connection_ = *std::move(connection);
    for (const v1::RemoteRegion& r : regions.regions()) {
      w->arena_ = transport::RegionDescriptor{r.address(), r.length(), r.rkey()};
    }
  }
  if (absl::Status s = w->StartLiveJob(); !s.ok()) return s;
  return w;
}

absl::Status RequestWorld::StartLiveJob() {
  const v1::JobSpec spec = LiveJobSpec(daemon_->address());
  auto fail = [](const char* what, const grpc::Status& s) {
    return absl::InternalError(absl::StrCat("the live job: ", what, ": ", s.error_message()));
  };
  if (grpc::Status s = client_->Register(spec, 0); !s.ok()) return fail("RegisterJob", s);
  if (grpc::Status s = client_->JoinAll(spec); !s.ok()) return fail("JoinJob", s);
  const uint64_t total = SampleLayout().total_elements();
  const std::vector<float> values = LiveParameters(total);
  if (grpc::Status s = client_->Init(ParamChunks(kLiveJobId, {0, total}, values.data())); !s.ok()) {
    return fail("InitParameters", s);
  }
  absl::StatusOr<std::shared_ptr<Job>> live = daemon_->jobs().Find(kLiveJobId);
  if (!live.ok()) return live.status();
  live_ = *std::move(live);
  live_hash_ = live_->StateHash();
  // The replicated job: this daemon is its index 0, the peer never answers.
  if (grpc::Status s = client_->Register(ReplicaJobSpec(daemon_->address()), 0); !s.ok()) {
    return absl::InternalError(
        absl::StrCat("the replicated job: RegisterJob: ", s.error_message()));
  }
  replica_snapshot_ = ReplicaSnapshot();
  live_ledger_bytes_ = daemon_->ledger().total();
  return absl::OkStatus();
}

std::string RequestWorld::ReplicaSnapshot() {
  std::string out;
  for (uint32_t group = 0; group < 2; ++group) {
    absl::StatusOr<std::shared_ptr<Job>> copy = daemon_->jobs().Find(kReplicaJobId, group);
    if (!copy.ok()) {
      absl::StrAppend(&out, "group ", group, ": none\n");
      continue;
    }
    v1::ReplicaGroupState state;
    if (std::optional<ReplicaGroupStatus> r = (*copy)->ReplicaState(); r.has_value()) {
      ToWire(*r, &state);
    }
    absl::StrAppend(&out, "group ", group, ": ", reinterpret_cast<uintptr_t>(copy->get()),
                    " hash ", (*copy)->StateHash(), " ", state.ShortDebugString(), "\n");
  }
  return out;
}

grpc::Status RequestWorld::Run(const Call& call) {
  if (live_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "the world was not restored");
  }
  Fixer f;
  f.fixups = call.fixups;
  f.live = &live_->spec();
  f.layout = &live_->config().layout;
  f.max_wait_ms = options_.max_wait_ms;
  f.last_part = last_part_.get();
  f.push_memory = push_memory_.get();
  f.push_memory_id = push_memory_id_;
  if (absl::StatusOr<std::shared_ptr<Job>> live = daemon_->jobs().Find(kLiveJobId); live.ok()) {
    f.committed = (*live)->committed_step();
  }
  if (absl::StatusOr<std::shared_ptr<Job>> backup =
          daemon_->jobs().Find(kReplicaJobId, kReplicaBackupGroup);
      backup.ok()) {
    const std::optional<ReplicaGroupStatus> state = (*backup)->ReplicaState();
    f.backup.present = true;
    f.backup.epoch = state.has_value() ? state->epoch : 0;
    f.backup.committed = state.has_value() ? state->committed_step : 0;
    f.backup.owned = (*backup)->owned_unpadded();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(options_.call_deadline));
  v1::Control::Stub& control = *client_->control;
  v1::Shard::Stub& shard = *client_->shard;
  v1::Admin::Stub& admin = *client_->admin;
  v1::Checkpoint::Stub& checkpoint = *client_->checkpoint;
  v1::Activation::Stub& activation = *activation_;
  v1::Replica::Stub& replica = *replica_;

// One request message and one answer.
#define ZS_UNARY(stub, Method, Request, Response)           \
  {                                                         \
    Request request;                                        \
    if (!Parse(call, f, &request)) return Unparsable(call); \
    Response response;                                      \
    return stub.Method(&ctx, request, &response);           \
  }

  switch (call.rpc) {
    case Rpc::kRegisterJob:
      ZS_UNARY(control, RegisterJob, v1::RegisterJobRequest, v1::RegisterJobResponse)
    case Rpc::kJoinJob:
      ZS_UNARY(control, JoinJob, v1::JoinJobRequest, v1::JoinJobResponse)
    case Rpc::kGetPartitionMap:
      ZS_UNARY(control, GetPartitionMap, v1::GetPartitionMapRequest, v1::PartitionMap)
    case Rpc::kHeartbeat:
      ZS_UNARY(control, Heartbeat, v1::HeartbeatRequest, v1::HeartbeatResponse)
    case Rpc::kLeave:
      ZS_UNARY(control, Leave, v1::LeaveRequest, v1::LeaveResponse)
    case Rpc::kInitParameters: {
      std::vector<v1::ParameterChunk> chunks;
      if (!ParseStream(call, f, &chunks)) return Unparsable(call);
      v1::InitParametersResponse response;
      return SendStream(&ctx, chunks,
                        [&](grpc::ClientContext* c) { return shard.InitParameters(c, &response); });
    }
    case Rpc::kPushGradient: {
      std::vector<v1::GradientChunk> chunks;
      if (!ParseStream(call, f, &chunks)) return Unparsable(call);
      v1::PushGradientResponse response;
      return SendStream(&ctx, chunks,
                        [&](grpc::ClientContext* c) { return shard.PushGradient(c, &response); });
    }
    case Rpc::kGather: {
      v1::GatherRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      return ReadAll<v1::ParameterChunk>(shard.Gather(&ctx, request));
    }
    case Rpc::kPrepareStep:
      ZS_UNARY(shard, PrepareStep, v1::PrepareStepRequest, v1::PrepareStepResponse)
    case Rpc::kCommitStep:
      ZS_UNARY(shard, CommitStep, v1::CommitStepRequest, v1::CommitStepResponse)
    case Rpc::kGetStepState:
      ZS_UNARY(shard, GetStepState, v1::GetStepStateRequest, v1::StepState)
    case Rpc::kExchangeEndpoint:
      ZS_UNARY(shard, ExchangeEndpoint, v1::ExchangeEndpointRequest, v1::ExchangeEndpointResponse)
    case Rpc::kFenceStagingSlot:
      ZS_UNARY(shard, FenceStagingSlot, v1::FenceStagingSlotRequest, v1::FenceStagingSlotResponse)
    case Rpc::kMemoryReport:
      ZS_UNARY(admin, MemoryReport, v1::MemoryReportRequest, v1::MemoryReportResponse)
    case Rpc::kStatus:
      ZS_UNARY(admin, Status, v1::StatusRequest, v1::StatusResponse)
    case Rpc::kEstimate:
      ZS_UNARY(admin, Estimate, v1::EstimateRequest, v1::EstimateResponse)
    case Rpc::kSaveCheckpoint:
      ZS_UNARY(checkpoint, SaveCheckpoint, v1::SaveCheckpointRequest, v1::SaveCheckpointResponse)
    case Rpc::kGetCheckpointStatus: {
      v1::GetCheckpointStatusRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      v1::CheckpointStatus response;
      grpc::Status s = checkpoint.GetCheckpointStatus(&ctx, request, &response);
      if (s.ok() && response.state() == v1::CheckpointStatus::STATE_WRITTEN &&
          response.has_part()) {
        last_part_ = std::make_unique<v1::PartManifest>(response.part());
      }
      return s;
    }
    case Rpc::kCompleteCheckpoint:
      ZS_UNARY(checkpoint, CompleteCheckpoint, v1::CompleteCheckpointRequest,
               v1::CompleteCheckpointResponse)
    case Rpc::kLoadCheckpoint:
      ZS_UNARY(checkpoint, LoadCheckpoint, v1::LoadCheckpointRequest, v1::LoadCheckpointResponse)
    case Rpc::kListCheckpoints:
      ZS_UNARY(checkpoint, ListCheckpoints, v1::ListCheckpointsRequest, v1::ListCheckpointsResponse)
    case Rpc::kVerifyCheckpoint:
      ZS_UNARY(checkpoint, VerifyCheckpoint, v1::VerifyCheckpointRequest,
               v1::VerifyCheckpointResponse)
    case Rpc::kReserveActivation: {
      v1::ReserveActivationRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      return RunReserve(&ctx, std::move(request), f.on(kFitData));
    }
    case Rpc::kCommitActivation: {
      v1::CommitActivationRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      if (f.on(kChecksums)) request.set_crc32c(last_put_crc_);
      v1::ActivationStored response;
      return activation.CommitActivation(&ctx, request, &response);
    }
    case Rpc::kOffloadActivation: {
      std::vector<v1::ActivationChunk> chunks;
      if (!ParseStream(call, f, &chunks)) return Unparsable(call);
      v1::ActivationStored response;
      return SendStream(&ctx, chunks, [&](grpc::ClientContext* c) {
        return activation.OffloadActivation(c, &response);
      });
    }
    case Rpc::kLocateActivation:
      ZS_UNARY(activation, LocateActivation, v1::LocateActivationRequest, v1::ActivationPlacement)
    case Rpc::kFetchActivation: {
      v1::FetchActivationRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      return ReadAll<v1::ActivationChunk>(activation.FetchActivation(&ctx, request));
    }
    case Rpc::kPrefetchActivations:
      ZS_UNARY(activation, PrefetchActivations, v1::PrefetchActivationsRequest,
               v1::PrefetchActivationsResponse)
    case Rpc::kFreeActivations:
      ZS_UNARY(activation, FreeActivations, v1::FreeActivationsRequest, v1::FreeActivationsResponse)
    case Rpc::kReadState: {
      v1::ReadStateRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      return ReadAll<v1::StateChunk>(shard.ReadState(&ctx, request));
    }
    case Rpc::kWriteState: {
      std::vector<v1::StateChunk> chunks;
      if (!ParseStream(call, f, &chunks)) return Unparsable(call);
      v1::WriteStateResponse response;
      return SendStream(&ctx, chunks,
                        [&](grpc::ClientContext* c) { return shard.WriteState(c, &response); });
    }
    case Rpc::kGetReplicaState:
      ZS_UNARY(replica, GetReplicaState, v1::GetReplicaStateRequest, v1::ReplicaState)
    case Rpc::kPromote:
      ZS_UNARY(replica, Promote, v1::PromoteRequest, v1::ReplicaState)
    case Rpc::kTransferState: {
      std::vector<v1::ReplicaStateChunk> chunks;
      if (!ParseStream(call, f, &chunks)) return Unparsable(call);
      v1::TransferStateResponse response;
      return SendStream(
          &ctx, chunks, [&](grpc::ClientContext* c) { return replica.TransferState(c, &response); });
    }
    case Rpc::kForwardGradient: {
      std::vector<v1::ForwardedGradientChunk> chunks;
      if (!ParseStream(call, f, &chunks)) return Unparsable(call);
      v1::ForwardGradientResponse response;
      return SendStream(&ctx, chunks, [&](grpc::ClientContext* c) {
        return replica.ForwardGradient(c, &response);
      });
    }
    case Rpc::kCommitReplica:
      ZS_UNARY(replica, CommitReplica, v1::CommitReplicaRequest, v1::CommitStepResponse)
    case Rpc::kReleaseReplica:
      ZS_UNARY(replica, ReleaseReplica, v1::ReleaseReplicaRequest, v1::ReleaseReplicaResponse)
    case Rpc::kMapPushMemory: {
      v1::MapPushMemoryRequest request;
      if (!Parse(call, f, &request)) return Unparsable(call);
      v1::MapPushMemoryResponse response;
      grpc::Status s = shard.MapPushMemory(&ctx, request, &response);
      if (s.ok()) push_memory_id_ = response.id();
      return s;
    }
  }
#undef ZS_UNARY
  return grpc::Status(grpc::StatusCode::INTERNAL, "no such rpc");
}

grpc::Status RequestWorld::RunReserve(grpc::ClientContext* ctx,
                                      v1::ReserveActivationRequest request, bool put) {
  v1::ActivationPlacement placement;
  grpc::Status s = activation_->ReserveActivation(ctx, request, &placement);
  if (!s.ok() || !put || arena_connection_ == nullptr) return s;
  if (placement.bytes() > kMaxFittedBytes || placement.offset() > arena_.length ||
      placement.bytes() > arena_.length - placement.offset()) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat("placement [", placement.offset(), ", +", placement.bytes(),
                                     ") is outside the arena of ", arena_.length, " bytes"));
  }
  const std::string bytes =
      Tile(absl::StrCat("slice ", request.key().layer(), " "), placement.bytes());
  last_put_crc_ = Crc32c(bytes.data(), bytes.size());
  absl::Status put_status =
      arena_connection_->Put(bytes.data(), bytes.size(), arena_, placement.offset())
          .Wait(absl::Now() + options_.call_deadline);
  if (!put_status.ok()) {
    return grpc::Status(grpc::StatusCode::UNKNOWN,
                        absl::StrCat("put into the arena: ", put_status.ToString()));
  }
  return s;
}

absl::Status RequestWorld::CheckInvariants() {
  const uint64_t total = daemon_->ledger().total();
  if (options_.memory_limit_bytes != 0 && total > options_.memory_limit_bytes) {
    return absl::InternalError(absl::StrCat("the ledger holds ", total,
                                            " bytes, over the memory limit of ",
                                            options_.memory_limit_bytes));
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StatusResponse status;
  grpc::Status s = client_->admin->Status(&ctx, v1::StatusRequest(), &status);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("Admin.Status failed: ", s.error_code(), " ", s.error_message()));
  }
  if (status.draining()) return absl::InternalError("the daemon is draining");
  return absl::OkStatus();
}

bool RequestWorld::Changed() {
  absl::StatusOr<std::shared_ptr<Job>> live = daemon_->jobs().Find(kLiveJobId);
  if (!live.ok() || *live != live_) return true;
  if (daemon_->jobs().size() != 2 || daemon_->jobs().retired() != 0) return true;
  if (live_->StateHash() != live_hash_) return true;
  if (ReplicaSnapshot() != replica_snapshot_) return true;
  if (daemon_->ledger().total() != live_ledger_bytes_) return true;
  if (ActivationStore* store = daemon_->activations(); store != nullptr) {
    const ActivationStore::Stats stats = store->GetStats();
    if (stats.slices != 0 || stats.in_flight != 0 || stats.spill_used != 0 ||
        stats.dropped_files != 0) {
      return true;
    }
  }
  std::error_code error;
  const bool empty = std::filesystem::is_empty(dir_ + "/checkpoints", error);
  return error || !empty;
}

absl::Status RequestWorld::Restore(absl::Duration settle) {
  last_part_.reset();
  push_memory_id_ = 0;
  if (!Changed()) return absl::OkStatus();
  live_.reset();
  JobManager& jobs = daemon_->jobs();
  for (const std::shared_ptr<Job>& job : jobs.All()) jobs.Remove(job);
  // Calls the client gave up on may still hold a job for a moment.
  const absl::Time until = absl::Now() + settle;
  while (true) {
    jobs.Tick();
    const uint64_t total = daemon_->ledger().total();
    ActivationStore::Stats stats;
    if (daemon_->activations() != nullptr) stats = daemon_->activations()->GetStats();
    const bool settled = jobs.size() == 0 && jobs.retired() == 0 && total == empty_ledger_bytes_ &&
                         stats.slices == 0 && stats.in_flight == 0 && stats.spill_used == 0 &&
                         stats.dropped_files == 0;
    if (settled) break;
    if (absl::Now() > until) {
      return absl::InternalError(absl::StrCat(
          "with every job removed for ", absl::FormatDuration(settle), ": ", jobs.size(), " jobs, ",
          jobs.retired(), " retired, the ledger holds ", total, " bytes (", empty_ledger_bytes_,
          " before any job), the activation store ", stats.slices, " slices, ", stats.in_flight,
          " transfers in flight, ", stats.spill_used, " spilled bytes"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir_ + "/checkpoints", error)) {
    std::filesystem::remove_all(entry.path(), error);
  }
  return StartLiveJob();
}

// ---------------------------------------------------------------------------
// Seeds.

namespace {

template <typename Message>
Call One(Rpc rpc, uint8_t fixups, const Message& m) {
  return Call{rpc, fixups, {m.SerializeAsString()}};
}

template <typename Message>
Call Stream(Rpc rpc, uint8_t fixups, const std::vector<Message>& chunks) {
  Call call{rpc, fixups, {}};
  for (const Message& m : chunks) call.messages.push_back(m.SerializeAsString());
  return call;
}

constexpr uint8_t kLive = kLiveJob | kLiveRank;
constexpr uint8_t kAll = kLiveJob | kLiveRank | kChecksums | kFitData | kLiveStep;

v1::FlatRange Range(uint64_t begin, uint64_t end) {
  v1::FlatRange r;
  r.set_begin(begin);
  r.set_end(end);
  return r;
}

// One fp32 gradient chunk of `range`, `value` in every element once fitted.
v1::GradientChunk Gradient(uint32_t rank, uint64_t step, const v1::FlatRange& range, float value) {
  v1::GradientChunk c;
  c.set_job_id(kLiveJobId);
  c.set_step(step);
  c.set_rank(rank);
  c.set_incarnation(kTestIncarnation);
  *c.mutable_range() = range;
  c.set_dtype(v1::DTYPE_FP32);
  c.set_data(reinterpret_cast<const char*>(&value), sizeof(value));
  return c;
}

v1::ActivationOwner Owner(uint32_t rank) {
  v1::ActivationOwner o;
  o.set_job_id(kLiveJobId);
  o.set_rank(rank);
  o.set_incarnation(kTestIncarnation);
  return o;
}

v1::ActivationKey Key(uint64_t step, uint32_t layer) {
  v1::ActivationKey k;
  k.set_step(step);
  k.set_layer(layer);
  k.set_micro_batch(0);
  k.set_mp_rank(0);
  k.set_mp_size(1);
  return k;
}

// Both ranks' gradients for `step`, each partition in a stream of its own
// (as a trainer-collective rank pushes; daemon reduction also takes chunks
// across partitions), then the leader's prepare and commit.
std::vector<Call> TrainingStep(uint64_t step) {
  const Layout layout = SampleLayout();
  const PartitionMap map = *PartitionMap::Create(layout.total_elements(), kLiveWorldSize);
  std::vector<Call> calls;
  for (uint32_t rank = 0; rank < kLiveWorldSize; ++rank) {
    for (uint32_t p = 0; p < kLiveWorldSize; ++p) {
      const FlatRange r = map.UnpaddedPartition(p);
      // Two chunks per stream.
      const uint64_t mid = r.begin + r.size() / 2;
      calls.push_back(Stream(Rpc::kPushGradient, kAll,
                             std::vector<v1::GradientChunk>{
                                 Gradient(rank, step, Range(r.begin, mid), 0.01f * (rank + 1)),
                                 Gradient(rank, step, Range(mid, r.end), -0.02f)}));
    }
  }
  v1::PrepareStepRequest prepare;
  prepare.set_job_id(kLiveJobId);
  prepare.set_step(step);
  calls.push_back(One(Rpc::kPrepareStep, kAll, prepare));
  v1::CommitStepRequest commit;
  commit.set_job_id(kLiveJobId);
  commit.set_step(step);
  commit.set_lr(1e-3f);
  commit.set_clip_coef(1.0f);
  commit.set_rank(0);
  commit.set_incarnation(kTestIncarnation);
  calls.push_back(One(Rpc::kCommitStep, kAll, commit));
  return calls;
}

v1::GatherRequest GatherAll(uint64_t after_step) {
  v1::GatherRequest g;
  g.set_job_id(kLiveJobId);
  g.set_after_step(after_step);
  *g.mutable_range() = Range(0, SampleLayout().total_elements());
  g.set_dtype(v1::DTYPE_FP32);
  g.set_wait_ms(50);
  return g;
}

v1::ReadStateRequest ReadState(uint32_t rank, v1::StateArray array, const v1::FlatRange& range) {
  v1::ReadStateRequest r;
  r.set_job_id(kLiveJobId);
  r.set_rank(rank);
  r.set_incarnation(kTestIncarnation);
  r.set_array(array);
  *r.mutable_range() = range;
  return r;
}

// A WriteState chunk of the live job carrying `data` as it is (kFitData
// tiles it to the range).
v1::StateChunk StateData(uint32_t rank, v1::StateArray array, const v1::FlatRange& range,
                         const std::string& data) {
  v1::StateChunk c;
  c.set_job_id(kLiveJobId);
  c.set_rank(rank);
  c.set_incarnation(kTestIncarnation);
  c.set_array(array);
  *c.mutable_range() = range;
  c.set_data(data);
  return c;
}

std::string Float(float value) { return std::string(reinterpret_cast<const char*>(&value), 4); }

v1::TensorStep Steps(uint32_t tensor, uint64_t steps) {
  v1::TensorStep t;
  t.set_tensor(tensor);
  t.set_steps(steps);
  return t;
}

// Replica calls of the replicated job's backup group at its first epoch.
v1::ReplicaStateChunk StateChunk(uint32_t array, const std::string& data) {
  v1::ReplicaStateChunk c;
  c.set_job_id(kReplicaJobId);
  c.set_group(kReplicaBackupGroup);
  c.set_epoch(1);
  c.set_array(array);
  c.set_data(data);
  return c;
}

// A whole transfer of the committed state at step 0 (kFitData tiles each
// array's value over the backup's range): masters, then both moments.
std::vector<v1::ReplicaStateChunk> Transfer() {
  v1::ReplicaStateChunk masters = StateChunk(0, Float(0.25f));
  v1::TrainingState* state = masters.mutable_state();
  state->set_committed_step(0);
  state->set_loss_scale(1.0f);
  v1::ReplicaStateChunk exp_avg = StateChunk(1, Float(1e-3f));
  v1::ReplicaStateChunk exp_avg_sq = StateChunk(2, Float(1e-6f));
  exp_avg_sq.clear_job_id();  // later chunks may leave it out
  return {masters, exp_avg, exp_avg_sq};
}

// The gradient of step 1 in two chunks (kFitData lays them over the
// backup's range).
std::vector<v1::ForwardedGradientChunk> Forward() {
  v1::ForwardedGradientChunk first;
  first.set_job_id(kReplicaJobId);
  first.set_group(kReplicaBackupGroup);
  first.set_epoch(1);
  first.set_step(1);
  *first.mutable_range() = Range(0, 1000);
  first.set_data(Float(0.01f));
  first.mutable_prepared()->set_grad_sq_sum(0.5);
  v1::ForwardedGradientChunk second = first;
  second.clear_job_id();
  second.clear_prepared();
  second.set_data(Float(-0.02f));
  return {first, second};
}

v1::CommitReplicaRequest CommitReplica() {
  v1::CommitReplicaRequest r;
  r.set_job_id(kReplicaJobId);
  r.set_group(kReplicaBackupGroup);
  r.set_epoch(1);
  v1::CommitStepRequest* commit = r.mutable_commit();
  commit->set_job_id(kReplicaJobId);
  commit->set_step(1);
  commit->set_lr(1e-3f);
  commit->set_clip_coef(1.0f);
  return r;
}

v1::GetReplicaStateRequest ReplicaState(const std::string& job_id) {
  v1::GetReplicaStateRequest r;
  r.set_job_id(job_id);
  return r;
}

// SampleLayout with parameter groups (big.* in group 1), a frozen tensor
// (head) and an alias (embed's).
Layout GroupedLayout() {
  const Layout sample = SampleLayout();
  std::vector<TensorSpec> specs;
  for (const TensorPlacement& t : sample.tensors()) specs.push_back(t.spec);
  specs[0].aliases = {"lm_head.weight"};
  specs[3].group = 1;
  specs[4].group = 1;
  specs[5].frozen = true;
  return *Layout::Create(std::move(specs));
}

}  // namespace

std::vector<std::pair<std::string, std::vector<Call>>> SeedSequences() {
  std::vector<std::pair<std::string, std::vector<Call>>> seeds;
  const uint64_t total = SampleLayout().total_elements();

  {  // What anyone may look at.
    std::vector<Call> c;
    c.push_back(One(Rpc::kStatus, 0, v1::StatusRequest()));
    v1::MemoryReportRequest memory;
    memory.set_job_id(kLiveJobId);
    c.push_back(One(Rpc::kMemoryReport, kLiveJob, memory));
    c.push_back(One(Rpc::kMemoryReport, 0, v1::MemoryReportRequest()));
    v1::EstimateRequest estimate;
    estimate.set_parameters(7.5e9);
    estimate.set_world_size(64);
    estimate.set_device_memory_bytes(32ull << 30);
    c.push_back(One(Rpc::kEstimate, 0, estimate));
    v1::GetPartitionMapRequest map;
    map.set_job_id(kLiveJobId);
    c.push_back(One(Rpc::kGetPartitionMap, kLiveJob, map));
    v1::GetStepStateRequest state;
    state.set_job_id(kLiveJobId);
    c.push_back(One(Rpc::kGetStepState, kLiveJob, state));
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_job_id(kLiveJobId);
    heartbeat.set_rank(1);
    heartbeat.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kHeartbeat, kLive, heartbeat));
    seeds.emplace_back("observe", std::move(c));
  }
  {  // Two training steps and a gather after each.
    std::vector<Call> c;
    for (uint64_t step = 1; step <= 2; ++step) {
      for (Call& call : TrainingStep(step)) c.push_back(std::move(call));
      c.push_back(One(Rpc::kGather, kAll, GatherAll(step)));
    }
    seeds.emplace_back("two_steps", std::move(c));
  }
  {  // A gather waiting for a step nobody commits, one in bf16 (refused: the
     // job is fp32), and one that only waits (bulk readers).
    std::vector<Call> c;
    v1::GatherRequest ahead = GatherAll(1);
    ahead.set_wait_ms(30);
    c.push_back(One(Rpc::kGather, kLive, ahead));
    v1::GatherRequest bf16 = GatherAll(0);
    bf16.set_dtype(v1::DTYPE_BF16);
    c.push_back(One(Rpc::kGather, kLive, bf16));
    v1::GatherRequest wait_only = GatherAll(0);
    wait_only.set_wait_only(true);
    c.push_back(One(Rpc::kGather, kLive, wait_only));
    seeds.emplace_back("gathers", std::move(c));
  }
  {  // A step, a checkpoint of it, its completion, and loading it back.
    std::vector<Call> c = TrainingStep(1);
    v1::SaveCheckpointRequest save;
    save.set_job_id(kLiveJobId);
    save.set_name("ckpt-1");
    save.set_step(1);
    c.push_back(One(Rpc::kSaveCheckpoint, kLiveJob | kLiveStep, save));
    v1::GetCheckpointStatusRequest status;
    status.set_job_id(kLiveJobId);
    status.set_name("ckpt-1");
    status.set_wait_ms(100);
    for (int i = 0; i < 3; ++i) c.push_back(One(Rpc::kGetCheckpointStatus, kLiveJob, status));
    v1::CompleteCheckpointRequest complete;
    complete.set_job_id(kLiveJobId);
    complete.set_name("ckpt-1");
    c.push_back(One(Rpc::kCompleteCheckpoint, kLiveJob | kLastPart, complete));
    v1::ListCheckpointsRequest list;
    list.set_job_id(kLiveJobId);
    c.push_back(One(Rpc::kListCheckpoints, kLiveJob, list));
    v1::VerifyCheckpointRequest verify;
    verify.set_job_id(kLiveJobId);
    verify.set_name("latest");
    c.push_back(One(Rpc::kVerifyCheckpoint, kLiveJob, verify));
    for (Call& call : TrainingStep(2)) c.push_back(std::move(call));
    v1::LoadCheckpointRequest load;
    load.set_job_id(kLiveJobId);
    load.set_name("latest");
    c.push_back(One(Rpc::kLoadCheckpoint, kLiveJob, load));
    c.push_back(One(Rpc::kGather, kAll, GatherAll(1)));
    seeds.emplace_back("checkpoint_and_load", std::move(c));
  }
  {  // Activation checkpoints over the streaming RPCs: offload two slices,
     // find, fetch and prefetch them, free one, then the step.
    std::vector<Call> c;
    for (uint32_t layer = 0; layer < 2; ++layer) {
      v1::ActivationChunk first;
      *first.mutable_owner() = Owner(0);
      *first.mutable_key() = Key(1, layer);
      first.set_total_bytes(96 << 10);
      first.set_offset(0);
      first.set_data("activation");
      v1::ActivationChunk second;
      second.set_offset(64 << 10);
      second.set_data("slice");
      c.push_back(
          Stream(Rpc::kOffloadActivation, kAll, std::vector<v1::ActivationChunk>{first, second}));
    }
    v1::LocateActivationRequest locate;
    *locate.mutable_owner() = Owner(0);
    *locate.mutable_key() = Key(1, 1);
    c.push_back(One(Rpc::kLocateActivation, kLive, locate));
    v1::FetchActivationRequest fetch;
    *fetch.mutable_owner() = Owner(0);
    *fetch.mutable_key() = Key(1, 1);
    fetch.set_max_chunk_bytes(32 << 10);
    c.push_back(One(Rpc::kFetchActivation, kLive, fetch));
    v1::PrefetchActivationsRequest prefetch;
    *prefetch.mutable_owner() = Owner(0);
    *prefetch.add_keys() = Key(1, 0);
    *prefetch.add_keys() = Key(1, 1);
    c.push_back(One(Rpc::kPrefetchActivations, kLive, prefetch));
    v1::FreeActivationsRequest free_one;
    *free_one.mutable_owner() = Owner(0);
    *free_one.mutable_key() = Key(1, 1);
    c.push_back(One(Rpc::kFreeActivations, kLive, free_one));
    v1::FreeActivationsRequest free_step;
    *free_step.mutable_owner() = Owner(0);
    *free_step.mutable_key() = Key(1, 0);
    free_step.set_whole_step(true);
    c.push_back(One(Rpc::kFreeActivations, kLive, free_step));
    seeds.emplace_back("activations_streamed", std::move(c));
  }
  {  // Activation checkpoints placed in the arena (the bulk path): reserve,
     // put, commit, locate; then slices past the arena's size, which spill,
     // a fetch of one of them, and a free of the first where it was
     // reserved.
    std::vector<Call> c;
    v1::ReserveActivationRequest reserve;
    *reserve.mutable_owner() = Owner(1);
    *reserve.mutable_key() = Key(1, 0);
    reserve.set_bytes(8192);
    c.push_back(One(Rpc::kReserveActivation, kLive | kFitData, reserve));
    v1::CommitActivationRequest commit;
    *commit.mutable_owner() = Owner(1);
    *commit.mutable_key() = Key(1, 0);
    c.push_back(One(Rpc::kCommitActivation, kLive | kChecksums, commit));
    v1::LocateActivationRequest locate;
    *locate.mutable_owner() = Owner(1);
    *locate.mutable_key() = Key(1, 0);
    c.push_back(One(Rpc::kLocateActivation, kLive, locate));
    for (uint32_t layer = 1; layer <= 5; ++layer) {
      v1::ActivationChunk big;
      *big.mutable_owner() = Owner(1);
      *big.mutable_key() = Key(1, layer);
      big.set_total_bytes(1 << 20);
      big.set_data("spill me");
      c.push_back(Stream(Rpc::kOffloadActivation, kAll, std::vector<v1::ActivationChunk>{big}));
    }
    v1::FetchActivationRequest fetch;
    *fetch.mutable_owner() = Owner(1);
    *fetch.mutable_key() = Key(1, 1);
    c.push_back(One(Rpc::kFetchActivation, kLive, fetch));
    // The end of a fetch read without locating: freed if the slice is still
    // where reservation 1 (its own) put it, else `moved` (OK either way).
    v1::FreeActivationsRequest release;
    *release.mutable_owner() = Owner(1);
    *release.mutable_key() = Key(1, 0);
    release.set_if_placement(1);
    c.push_back(One(Rpc::kFreeActivations, kLive, release));
    seeds.emplace_back("activations_placed", std::move(c));
  }
  {  // The bulk path's endpoint, a staging slot fenced, and a staged push
     // into it.
    std::vector<Call> c;
    v1::ExchangeEndpointRequest exchange;
    exchange.set_job_id(kLiveJobId);
    exchange.set_rank(0);
    exchange.set_transport(v1::TRANSPORT_KIND_INPROC);
    exchange.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kExchangeEndpoint, kLive, exchange));
    v1::FenceStagingSlotRequest fence;
    fence.set_job_id(kLiveJobId);
    fence.set_rank(0);
    fence.set_incarnation(kTestIncarnation);
    fence.set_slot(0);
    fence.set_generation(1);
    c.push_back(One(Rpc::kFenceStagingSlot, kLive, fence));
    // The world's push memory mapped (kLiveRank names it), and a push
    // summed from it.
    v1::MapPushMemoryRequest map;
    map.set_job_id(kLiveJobId);
    map.set_rank(0);
    map.set_incarnation(kTestIncarnation);
    map.set_bytes(4096);
    c.push_back(One(Rpc::kMapPushMemory, kLive, map));
    v1::GradientChunk pulled = Gradient(0, 1, Range(1000, 2000), 0.0f);
    pulled.clear_data();
    pulled.set_staged(true);
    pulled.set_staging_slot(1);
    pulled.set_staging_generation(1);
    pulled.set_push_memory(1);
    c.push_back(
        Stream(Rpc::kPushGradient, kLive | kLiveStep, std::vector<v1::GradientChunk>{pulled}));
    v1::GradientChunk staged = Gradient(0, 1, Range(0, 1000), 0.0f);
    staged.clear_data();
    staged.set_staged(true);
    staged.set_staging_slot(0);
    staged.set_staging_generation(2);
    c.push_back(
        Stream(Rpc::kPushGradient, kLive | kLiveStep, std::vector<v1::GradientChunk>{staged}));
    v1::GetStepStateRequest state;
    state.set_job_id(kLiveJobId);
    c.push_back(One(Rpc::kGetStepState, kLiveJob, state));
    seeds.emplace_back("staged_push", std::move(c));
  }
  {  // A second job, with two parameter groups, a frozen tensor and an
     // alias: registered, joined, initialised, trained a step (a tensor
     // without a gradient, a learning rate per group), its moments read
     // (zeros for the frozen tensor), left.
    std::vector<Call> c;
    const Layout layout = GroupedLayout();
    v1::JobSpec spec = MakeSpec("fuzz-other", layout, 1, 1, {"127.0.0.1:7070"});
    v1::ParamGroup* fast = spec.add_param_groups();
    fast->set_lr(0.1f);
    fast->set_beta1(0.9f);
    fast->set_beta2(0.999f);
    fast->set_eps(1e-8f);
    fast->set_weight_decay(0.01f);
    v1::ParamGroup* slow = spec.add_param_groups();
    slow->set_lr(0.05f);
    slow->set_beta1(0.8f);
    slow->set_beta2(0.99f);
    slow->set_eps(1e-6f);
    slow->set_weight_decay(0.0f);
    v1::RegisterJobRequest reg;
    *reg.mutable_spec() = spec;
    reg.set_daemon_index(0);
    c.push_back(One(Rpc::kRegisterJob, kChecksums, reg));
    v1::JoinJobRequest join;
    join.set_job_id("fuzz-other");
    join.set_rank(0);
    join.set_layout_fingerprint(spec.layout_fingerprint());
    join.set_stage(1);
    join.set_world_size(1);
    join.set_precision(v1::DTYPE_FP32);
    join.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kJoinJob, 0, join));
    v1::ParameterChunk init;
    init.set_job_id("fuzz-other");
    *init.mutable_range() = Range(0, total);
    init.set_dtype(v1::DTYPE_FP32);
    const float one = 1.0f;
    init.set_data(reinterpret_cast<const char*>(&one), sizeof(one));
    c.push_back(
        Stream(Rpc::kInitParameters, kChecksums | kFitData, std::vector<v1::ParameterChunk>{init}));
    v1::GradientChunk grad = Gradient(0, 1, Range(0, total), 0.5f);
    grad.set_job_id("fuzz-other");
    grad.add_no_grad_tensors(2);  // l1.b
    c.push_back(
        Stream(Rpc::kPushGradient, kChecksums | kFitData, std::vector<v1::GradientChunk>{grad}));
    v1::PrepareStepRequest prepare;
    prepare.set_job_id("fuzz-other");
    prepare.set_step(1);
    prepare.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kPrepareStep, 0, prepare));
    v1::CommitStepRequest commit;
    commit.set_job_id("fuzz-other");
    commit.set_step(1);
    commit.set_lr(0.1f);
    commit.add_group_lrs(0.1f);
    commit.add_group_lrs(0.025f);
    commit.set_rank(0);
    commit.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kCommitStep, 0, commit));
    v1::ReadStateRequest moments = ReadState(0, v1::STATE_ARRAY_EXP_AVG, Range(0, total));
    moments.set_job_id("fuzz-other");
    c.push_back(One(Rpc::kReadState, 0, moments));
    v1::MemoryReportRequest memory;
    memory.set_job_id("fuzz-other");
    c.push_back(One(Rpc::kMemoryReport, 0, memory));
    v1::LeaveRequest leave;
    leave.set_job_id("fuzz-other");
    leave.set_rank(0);
    leave.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kLeave, 0, leave));
    seeds.emplace_back("second_job", std::move(c));
  }
  {  // State dicts: a write of what the daemon holds (changes nothing),
     // reads of each array, a write of every array and of update counts
     // (gaps zeroed by kFitData), a read of them back, then a step and a
     // gather.
    std::vector<Call> c;
    const std::vector<float> held = LiveParameters(total);
    const Layout layout = SampleLayout();
    const FlatRange embed = layout.tensors()[0].range();
    v1::StateChunk same = StateData(
        1, v1::STATE_ARRAY_MASTER, Range(100, 164),
        std::string(reinterpret_cast<const char*>(held.data() + 100), 64 * sizeof(float)));
    c.push_back(Stream(Rpc::kWriteState, kLive | kChecksums, std::vector<v1::StateChunk>{same}));
    c.push_back(One(Rpc::kReadState, kLive, ReadState(0, v1::STATE_ARRAY_MASTER, Range(0, total))));
    c.push_back(
        One(Rpc::kReadState, kLive, ReadState(1, v1::STATE_ARRAY_EXP_AVG, Range(1000, 2000))));
    // Three chunks, one per array; the first also sets two update counts.
    const uint64_t l1_end = layout.tensors()[2].range().end;
    v1::StateChunk masters =
        StateData(0, v1::STATE_ARRAY_MASTER, Range(0, embed.end), Float(0.25f));
    *masters.add_tensor_steps() = Steps(0, 3);
    *masters.add_tensor_steps() = Steps(1, 3);
    v1::StateChunk exp_avg = StateData(0, v1::STATE_ARRAY_EXP_AVG, Range(0, l1_end), Float(1e-3f));
    v1::StateChunk exp_avg_sq =
        StateData(0, v1::STATE_ARRAY_EXP_AVG_SQ, Range(0, l1_end), Float(1e-6f));
    exp_avg_sq.clear_job_id();  // later chunks may leave it out
    c.push_back(
        Stream(Rpc::kWriteState, kAll, std::vector<v1::StateChunk>{masters, exp_avg, exp_avg_sq}));
    c.push_back(
        One(Rpc::kReadState, kLive, ReadState(0, v1::STATE_ARRAY_EXP_AVG_SQ, Range(0, l1_end))));
    for (Call& call : TrainingStep(1)) c.push_back(std::move(call));
    c.push_back(One(Rpc::kGather, kAll, GatherAll(1)));
    c.push_back(One(Rpc::kReadState, kLive, ReadState(0, v1::STATE_ARRAY_MASTER, Range(0, total))));
    seeds.emplace_back("state_dict", std::move(c));
  }
  {  // The live job's ranks: one rejoins as a new incarnation, both leave
     // (the last removes the job).
    std::vector<Call> c;
    const v1::JobSpec spec = LiveJobSpec("127.0.0.1:7070");
    v1::JoinJobRequest rejoin;
    rejoin.set_job_id(kLiveJobId);
    rejoin.set_rank(1);
    rejoin.set_layout_fingerprint(spec.layout_fingerprint());
    rejoin.set_stage(spec.stage());
    rejoin.set_world_size(spec.world_size());
    rejoin.set_precision(spec.precision());
    rejoin.set_incarnation(2);
    c.push_back(One(Rpc::kJoinJob, kLiveJob, rejoin));
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_job_id(kLiveJobId);
    heartbeat.set_rank(1);
    heartbeat.set_incarnation(2);
    c.push_back(One(Rpc::kHeartbeat, kLiveJob, heartbeat));
    v1::LeaveRequest leave0;
    leave0.set_job_id(kLiveJobId);
    leave0.set_rank(0);
    leave0.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kLeave, kLiveJob, leave0));
    v1::LeaveRequest leave1 = leave0;
    leave1.set_rank(1);
    leave1.set_incarnation(2);
    c.push_back(One(Rpc::kLeave, kLiveJob, leave1));
    v1::GetStepStateRequest state;
    state.set_job_id(kLiveJobId);
    c.push_back(One(Rpc::kGetStepState, kLiveJob, state));
    seeds.emplace_back("ranks_leave", std::move(c));
  }
  {  // Refused requests: a bad checksum, a step out of turn, a commit by a
     // non-leader, a wait past the maximum, an unknown checkpoint.
    std::vector<Call> c;
    v1::GradientChunk bad_crc = Gradient(0, 1, Range(0, 100), 1.0f);
    bad_crc.set_crc32c(12345);
    c.push_back(
        Stream(Rpc::kPushGradient, kLiveJob | kFitData, std::vector<v1::GradientChunk>{bad_crc}));
    v1::PrepareStepRequest prepare;
    prepare.set_job_id(kLiveJobId);
    prepare.set_step(7);
    c.push_back(One(Rpc::kPrepareStep, kLiveJob, prepare));
    v1::CommitStepRequest commit;
    commit.set_job_id(kLiveJobId);
    commit.set_step(1);
    commit.set_lr(1.0f);
    commit.set_rank(1);
    commit.set_incarnation(kTestIncarnation);
    c.push_back(One(Rpc::kCommitStep, kLiveJob, commit));
    v1::GatherRequest too_long = GatherAll(0);
    too_long.set_wait_ms(kMaxWaitMs + 1);
    c.push_back(One(Rpc::kGather, kLiveJob, too_long));
    v1::LoadCheckpointRequest load;
    load.set_job_id(kLiveJobId);
    load.set_name("no-such-checkpoint");
    c.push_back(One(Rpc::kLoadCheckpoint, kLiveJob, load));
    v1::RegisterJobRequest reg;
    *reg.mutable_spec() = LiveJobSpec("127.0.0.1:7070");
    reg.mutable_spec()->set_world_size(3);
    c.push_back(One(Rpc::kRegisterJob, kLiveJob | kChecksums, reg));
    // State: no array named, a range past the parameters, an alignment gap
    // that is not zero, an incarnation that never joined.
    c.push_back(
        One(Rpc::kReadState, kLive, ReadState(0, v1::STATE_ARRAY_UNSPECIFIED, Range(0, total))));
    c.push_back(Stream(Rpc::kWriteState, kAll,
                       std::vector<v1::StateChunk>{StateData(
                           0, v1::STATE_ARRAY_MASTER, Range(total - 8, total + 8), Float(1.0f))}));
    const FlatRange embed = SampleLayout().tensors()[0].range();
    c.push_back(Stream(Rpc::kWriteState, kLive | kChecksums,
                       std::vector<v1::StateChunk>{
                           StateData(0, v1::STATE_ARRAY_MASTER, Range(embed.end - 2, embed.end + 2),
                                     std::string(4 * sizeof(float), '\x01'))}));
    v1::ReadStateRequest stale = ReadState(1, v1::STATE_ARRAY_MASTER, Range(0, total));
    stale.set_incarnation(kTestIncarnation + 7);
    c.push_back(One(Rpc::kReadState, kLiveJob, stale));
    seeds.emplace_back("refused", std::move(c));
  }
  {  // The replicated job's backup driven as its primary would: the state
     // copied, a step forwarded and committed, then promoted to primary.
    std::vector<Call> c;
    c.push_back(One(Rpc::kGetReplicaState, kLiveJob, ReplicaState(kReplicaJobId)));
    c.push_back(Stream(Rpc::kTransferState, kAll, Transfer()));
    c.push_back(Stream(Rpc::kForwardGradient, kAll, Forward()));
    c.push_back(One(Rpc::kCommitReplica, kAll, CommitReplica()));
    c.push_back(One(Rpc::kGetReplicaState, kLiveJob, ReplicaState(kReplicaJobId)));
    v1::PromoteRequest promote;
    promote.set_job_id(kReplicaJobId);
    promote.set_group(kReplicaBackupGroup);
    promote.set_epoch(2);
    promote.set_committed_step(1);
    c.push_back(One(Rpc::kPromote, kAll, promote));
    c.push_back(One(Rpc::kGetReplicaState, kLiveJob, ReplicaState(kReplicaJobId)));
    seeds.emplace_back("replica_driven", std::move(c));
  }
  {  // The backup's state copied, then released by its primary: the copy
     // goes, a forward to it finds nothing.
    std::vector<Call> c;
    c.push_back(Stream(Rpc::kTransferState, kAll, Transfer()));
    v1::ReleaseReplicaRequest release;
    release.set_job_id(kReplicaJobId);
    release.set_group(kReplicaBackupGroup);
    release.set_epoch(1);
    c.push_back(One(Rpc::kReleaseReplica, kLive, release));
    c.push_back(One(Rpc::kGetReplicaState, kLiveJob, ReplicaState(kReplicaJobId)));
    c.push_back(Stream(Rpc::kForwardGradient, kAll, Forward()));
    seeds.emplace_back("replica_released", std::move(c));
  }
  {  // Refused replica calls: a promotion, a forward and a commit before any
     // state was copied, a transfer from an older epoch, a release of the
     // group this daemon is primary of, an unknown job, a job that is not
     // replicated, a bad checksum, a transfer missing an array.
    std::vector<Call> c;
    v1::PromoteRequest promote;
    promote.set_job_id(kReplicaJobId);
    promote.set_group(kReplicaBackupGroup);
    promote.set_epoch(2);
    c.push_back(One(Rpc::kPromote, kLive, promote));
    c.push_back(Stream(Rpc::kForwardGradient, kAll, Forward()));
    c.push_back(One(Rpc::kCommitReplica, kAll, CommitReplica()));
    std::vector<v1::ReplicaStateChunk> old = Transfer();
    for (v1::ReplicaStateChunk& chunk : old) chunk.set_epoch(0);
    c.push_back(Stream(Rpc::kTransferState, kLiveJob | kFitData, old));
    v1::ReleaseReplicaRequest release;
    release.set_job_id(kReplicaJobId);
    release.set_group(0);
    release.set_epoch(1);
    c.push_back(One(Rpc::kReleaseReplica, kLiveJob, release));
    c.push_back(One(Rpc::kGetReplicaState, 0, ReplicaState("no-such-job")));
    v1::PromoteRequest not_replicated = promote;
    not_replicated.set_job_id(kLiveJobId);
    not_replicated.set_group(0);
    c.push_back(One(Rpc::kPromote, 0, not_replicated));
    std::vector<v1::ReplicaStateChunk> bad_crc = Transfer();
    bad_crc[0].set_crc32c(12345);
    c.push_back(Stream(Rpc::kTransferState, kLive | kFitData | kLiveStep, bad_crc));
    std::vector<v1::ReplicaStateChunk> short_of_one = Transfer();
    short_of_one.pop_back();
    c.push_back(Stream(Rpc::kTransferState, kAll, short_of_one));
    seeds.emplace_back("replica_refused", std::move(c));
  }
  return seeds;
}

}  // namespace zeroshard::testing
