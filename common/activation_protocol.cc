#include "common/activation_protocol.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

std::string DescribeActivationKey(const ActivationKey& key) {
  return absl::StrCat("step ", key.step, " micro-batch ", key.micro_batch, " layer ", key.layer,
                      " mp ", key.mp_rank, "/", key.mp_size);
}

absl::Status ValidateModelParallelRank(uint32_t mp_rank, uint32_t mp_size,
                                       absl::string_view prefix) {
  if (mp_size < 1 || mp_size > kMaxModelParallel) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "mp_size: must be in [1, ",
                                                   kMaxModelParallel, "], got ", mp_size));
  }
  if (mp_rank >= mp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "mp_rank: must be < mp_size (", mp_size, "), got ", mp_rank));
  }
  return absl::OkStatus();
}

absl::Status ValidateActivationKey(const ActivationKey& key, absl::string_view field) {
  return ValidateModelParallelRank(key.mp_rank, key.mp_size, absl::StrCat(field, "."));
}

absl::Status ValidateActivationSliceBytes(uint64_t bytes, absl::string_view field) {
  if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat(field, ": must be >= 1"));
  if (bytes > kMaxActivationSliceBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": at most ", kMaxActivationSliceBytes,
                                                   " bytes per slice, got ", bytes));
  }
  return absl::OkStatus();
}

void ActivationKeyToProto(const ActivationKey& key, v1::ActivationKey* out) {
  out->set_step(key.step);
  out->set_micro_batch(key.micro_batch);
  out->set_layer(key.layer);
  out->set_mp_rank(key.mp_rank);
  out->set_mp_size(key.mp_size);
}

v1::ActivationKey ActivationKeyToProto(const ActivationKey& key) {
  v1::ActivationKey out;
  ActivationKeyToProto(key, &out);
  return out;
}

ActivationKey ActivationKeyFromProto(const v1::ActivationKey& key) {
  ActivationKey out;
  out.step = key.step();
  out.micro_batch = key.micro_batch();
  out.layer = key.layer();
  out.mp_rank = key.mp_rank();
  out.mp_size = key.mp_size();
  return out;
}

absl::StatusOr<ActivationKey> ParseActivationKey(const v1::ActivationKey& key,
                                                 absl::string_view field) {
  ActivationKey out = ActivationKeyFromProto(key);
  absl::Status s = ValidateActivationKey(out, field);
  if (!s.ok()) return s;
  return out;
}

}  // namespace zeroshard
