#include "client/stream_data_path.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/rpc.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/protocol.h"

namespace zeroshard {
namespace {

constexpr uint64_t kInitChunkBytes = 4ull << 20;

}  // namespace

StreamDataPath::StreamDataPath(std::string address, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)), stub_(v1::Shard::NewStub(channel)) {}

std::string DescribePush(const GradientPush& push) {
  return absl::StrCat("PushGradient step ", push.step, " range [", push.range.begin, ", ",
                      push.range.end, ")");
}

std::string DescribeGather(const GatherRequestSpec& request) {
  return absl::StrCat("Gather after step ", request.after_step, " range [",
                      request.range.begin, ", ", request.range.end, ")");
}

v1::GatherRequest GatherRequestProto(const GatherRequestSpec& request) {
  v1::GatherRequest req;
  req.set_job_id(request.job_id);
  req.set_rank(request.rank);
  req.set_after_step(request.after_step);
  req.mutable_range()->set_begin(request.range.begin);
  req.mutable_range()->set_end(request.range.end);
  req.set_dtype(WireDType(request.dtype));
  req.set_wait_ms(static_cast<uint32_t>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(request.wait), 0, kMaxWaitMs)));
  return req;
}

v1::GradientChunk GradientChunkHeader(const GradientPush& push) {
  v1::GradientChunk chunk;
  chunk.set_job_id(push.job_id);
  chunk.set_step(push.step);
  chunk.set_rank(push.rank);
  chunk.set_incarnation(push.incarnation);
  chunk.mutable_range()->set_begin(push.range.begin);
  chunk.mutable_range()->set_end(push.range.end);
  chunk.set_dtype(WireDType(push.dtype));
  chunk.set_micro_batch(push.micro_batch);
  chunk.set_micro_batches(push.micro_batches);
  chunk.mutable_no_grad_tensors()->Add(push.no_grad_tensors.begin(), push.no_grad_tensors.end());
  return chunk;
}

uint64_t PushBytes(const GradientPush& push) { return push.range.size() * DTypeSize(push.dtype); }

std::string DescribePushes(absl::Span<const GradientPush> pushes) {
  if (pushes.size() == 1) return DescribePush(pushes[0]);
  return absl::StrCat(DescribePush(pushes[0]), " and ", pushes.size() - 1, " more in one stream");
}

absl::Status SendGradientChunks(v1::Shard::Stub* stub, absl::Span<const GradientPush> pushes,
                                absl::FunctionRef<void(size_t, v1::GradientChunk*)> chunk_of,
                                absl::Time deadline, absl::string_view address) {
  if (pushes.empty()) return absl::OkStatus();
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  // The call's headers go out with its first chunk, and its last chunk
  // half-closes the stream: one send for a push of one chunk (a staged
  // announcement) instead of three.
  context.set_initial_metadata_corked(true);
  v1::PushGradientResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::GradientChunk>> writer =
      stub->PushGradient(&context, &response);
  uint64_t elements = 0;
  bool written = true;
  v1::GradientChunk chunk;
  for (size_t i = 0; i < pushes.size() && written; ++i) {
    chunk.Clear();
    chunk_of(i, &chunk);
    elements += pushes[i].range.size();
    // A failed Write means the stream is broken; Finish reports why.
    written = i + 1 < pushes.size() ? writer->Write(chunk)
                                    : writer->Write(chunk, grpc::WriteOptions().set_last_message());
  }
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return DaemonError(status, address, DescribePushes(pushes));
  if (response.elements() != elements) {
    return absl::DataLossError(absl::StrCat("daemon ", address, ": ", DescribePushes(pushes),
                                            ": accepted ", response.elements(), " elements, sent ",
                                            elements));
  }
  return absl::OkStatus();
}

absl::Status StreamDataPath::SendInline(absl::Span<const GradientPush> pushes,
                                        absl::Time deadline) {
  return SendGradientChunks(
      stub_.get(), pushes,
      [&](size_t i, v1::GradientChunk* chunk) {
        const GradientPush& push = pushes[i];
        *chunk = GradientChunkHeader(push);
        chunk->set_data(static_cast<const char*>(push.data), PushBytes(push));
        chunk->set_crc32c(Crc32c(push.data, PushBytes(push)));
      },
      deadline, address_);
}

absl::StatusOr<uint64_t> StreamDataPath::PushGradient(const GradientPush& push,
                                                    absl::Time deadline) {
  absl::Status s = SendInline({push}, deadline);
  // The daemon says ALREADY_EXISTS only when the contribution it holds has
  // this chunk's CRC-32C: an earlier attempt delivered these very bytes.
  if (!s.ok() && !absl::IsAlreadyExists(s)) return s;
  return PushBytes(push);
}

std::vector<absl::StatusOr<uint64_t>> StreamDataPath::PushGradients(
    const std::vector<GradientPush>& pushes, absl::Time deadline) {
  if (pushes.size() == 1) return {PushGradient(pushes[0], deadline)};
  std::vector<absl::StatusOr<uint64_t>> results;
  if (pushes.empty()) return results;
  const absl::Status s = SendInline(pushes, deadline);
  for (const GradientPush& push : pushes) {
    if (absl::IsAlreadyExists(s)) {
      // Nothing of the batch was applied; each alone shows which are held.
      results.push_back(PushGradient(push, deadline));
    } else if (s.ok()) {
      results.push_back(PushBytes(push));
    } else {
      results.push_back(s);
    }
  }
  return results;
}

absl::StatusOr<uint64_t> StreamDataPath::InitParameters(const ParameterUpload& upload,
                                                      absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::InitParametersResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ParameterChunk>> writer =
      stub_->InitParameters(&context, &response);
  const uint64_t step = kInitChunkBytes / sizeof(float);
  v1::ParameterChunk chunk;
  chunk.set_job_id(upload.job_id);
  chunk.set_rank(upload.rank);
  chunk.set_dtype(v1::DTYPE_FP32);
  bool broken = false;
  for (uint64_t b = upload.range.begin; b < upload.range.end && !broken; b += step) {
    const uint64_t e = std::min(upload.range.end, b + step);
    const char* src = reinterpret_cast<const char*>(upload.values + (b - upload.range.begin));
    chunk.mutable_range()->set_begin(b);
    chunk.mutable_range()->set_end(e);
    chunk.set_data(src, (e - b) * sizeof(float));
    chunk.set_crc32c(Crc32c(chunk.data().data(), chunk.data().size()));
    broken = !writer->Write(chunk);
  }
  if (!broken) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  const std::string what = absl::StrCat("InitParameters range [", upload.range.begin, ", ",
                                        upload.range.end, ")");
  if (!status.ok()) return DaemonError(status, address_, what);
  if (response.elements() != upload.range.size()) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ", what, ": stored ",
                                            response.elements(), " elements, sent ",
                                            upload.range.size()));
  }
  return upload.range.size() * sizeof(float);
}

absl::StatusOr<uint64_t> StreamDataPath::Gather(const GatherRequestSpec& request, void* dst,
                                                absl::Time deadline) {
  // ABORTED: a commit tore the stream (the daemon holds no lock while it
  // writes); the gather is idempotent, so read it again.
  constexpr int kAttempts = 3;
  absl::StatusOr<uint64_t> r;
  for (int i = 0; i < kAttempts; ++i) {
    r = GatherOnce(request, dst, deadline);
    if (!absl::IsAborted(r.status())) break;
  }
  return r;
}

absl::StatusOr<uint64_t> StreamDataPath::GatherOnce(const GatherRequestSpec& request, void* dst,
                                                    absl::Time deadline) {
  const std::string what = DescribeGather(request);
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  std::unique_ptr<grpc::ClientReader<v1::ParameterChunk>> reader =
      stub_->Gather(&context, GatherRequestProto(request));
  const size_t esize = DTypeSize(request.dtype);
  uint64_t pos = request.range.begin;
  uint64_t bytes = 0;
  v1::ParameterChunk chunk;
  absl::Status bad;
  while (reader->Read(&chunk)) {
    const uint64_t b = chunk.range().begin(), e = chunk.range().end();
    if (b != pos || e <= b || e > request.range.end ||
        chunk.dtype() != WireDType(request.dtype) || chunk.data().size() != (e - b) * esize) {
      bad = absl::DataLossError(absl::StrCat(
          "daemon ", address_, ": ", what, ": unexpected chunk [", b, ", ", e, ") of ",
          chunk.data().size(), " bytes, dtype ", chunk.dtype(), ", expected one starting at ",
          pos));
      break;
    }
    if (chunk.crc32c() != 0 &&
        Crc32c(chunk.data().data(), chunk.data().size()) != chunk.crc32c()) {
      bad = absl::DataLossError(absl::StrCat("daemon ", address_, ": ", what, ": chunk [", b,
                                             ", ", e, ") fails its CRC-32C"));
      break;
    }
    std::memcpy(static_cast<char*>(dst) + (b - request.range.begin) * esize,
                chunk.data().data(), chunk.data().size());
    bytes += chunk.data().size();
    pos = e;
  }
  if (!bad.ok()) {
    context.TryCancel();
    reader->Finish();
    return bad;
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return DaemonError(status, address_, what);
  if (pos != request.range.end) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ", what,
                                            ": the stream ended at element ", pos));
  }
  return bytes;
}

absl::Status StreamDataPath::AwaitCommitted(const GatherRequestSpec& request,
                                          absl::Time deadline, uint64_t unreported_read_bytes) {
  v1::GatherRequest req = GatherRequestProto(request);
  req.set_wait_only(true);
  req.set_unreported_read_bytes(unreported_read_bytes);
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  std::unique_ptr<grpc::ClientReader<v1::ParameterChunk>> reader = stub_->Gather(&context, req);
  v1::ParameterChunk chunk;
  bool unexpected = false;
  while (reader->Read(&chunk)) unexpected = true;
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return DaemonError(status, address_, DescribeGather(request));
  if (unexpected) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ", DescribeGather(request),
                                            ": a wait_only gather returned data"));
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
