#include "server/rpc/grpc_param_fetcher.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/channel.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"

namespace zeroshard {

absl::StatusOr<uint64_t> GrpcParamFetcher::Fetch(uint32_t owner, const FlatRange& range,
                                                 DType dtype, uint64_t after_step,
                                                 absl::Time deadline, void* dst) {
  const std::string& peer = config_->daemons[owner];
  const std::string what = absl::StrCat("node cache: Gather after step ", after_step, " range [",
                                        range.begin, ", ", range.end, ") from daemon ", peer);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = channels_->Get(peer);
  if (!channel.ok()) return channel.status();
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  if (!token_.empty()) {
    context.AddMetadata(kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, token_));
  }
  v1::GatherRequest req;
  req.set_job_id(config_->job_id);
  req.set_after_step(after_step);
  req.mutable_range()->set_begin(range.begin);
  req.mutable_range()->set_end(range.end);
  req.set_dtype(WireDType(dtype));
  const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
  req.set_wait_ms(static_cast<uint32_t>(
      std::min<int64_t>(kMaxWaitMs, absl::ToInt64Milliseconds(left))));
  auto stub = v1::Shard::NewStub(*channel);
  std::unique_ptr<grpc::ClientReader<v1::ParameterChunk>> reader = stub->Gather(&context, req);
  const size_t esize = DTypeSize(dtype);
  uint64_t next = range.begin;
  std::optional<uint64_t> step;
  absl::Status bad;
  v1::ParameterChunk chunk;
  while (bad.ok() && reader->Read(&chunk)) {
    const uint64_t b = chunk.range().begin();
    const uint64_t e = chunk.range().end();
    if (chunk.dtype() != req.dtype() || b != next || e <= b || e > range.end ||
        chunk.data().size() != (e - b) * esize) {
      bad = absl::DataLossError(absl::StrCat(what, ": a chunk of range [", b, ", ", e,
                                             ") does not continue the range at ", next));
    } else if (Crc32c(chunk.data().data(), chunk.data().size()) != chunk.crc32c()) {
      bad = absl::DataLossError(absl::StrCat(what, ": CRC-32C mismatch in [", b, ", ", e, ")"));
    } else if (step.has_value() && *step != chunk.step()) {
      bad = absl::DataLossError(absl::StrCat(what, ": chunks of steps ", *step, " and ",
                                             chunk.step(), " in one stream"));
    } else {
      step = chunk.step();
      std::memcpy(static_cast<uint8_t*>(dst) + (b - range.begin) * esize, chunk.data().data(),
                  chunk.data().size());
      next = e;
    }
  }
  if (!bad.ok()) {
    context.TryCancel();
    (void)reader->Finish();
    return bad;
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) channels_->Drop(peer);
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat(what, ": ", s.error_message()));
  }
  if (next != range.end || !step.has_value()) {
    return absl::DataLossError(
        absl::StrCat(what, ": the stream ended at ", next, " of [", range.begin, ", ", range.end,
                     ")"));
  }
  return *step;
}

}  // namespace zeroshard
