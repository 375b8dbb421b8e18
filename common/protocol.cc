#include "common/protocol.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::StatusOr<v1::TransportKind> TransportKindFromName(absl::string_view name,
                                                        absl::string_view field) {
  if (name == "ucx") return v1::TRANSPORT_KIND_UCX;
  if (name == "grpc") return v1::TRANSPORT_KIND_GRPC;
  if (name == "inproc") return v1::TRANSPORT_KIND_INPROC;
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": unknown bulk transport \"", name.substr(0, 64), "\" (one of ucx, grpc, inproc)"));
}

absl::string_view TransportKindName(v1::TransportKind kind) {
  switch (kind) {
    case v1::TRANSPORT_KIND_UCX: return "ucx";
    case v1::TRANSPORT_KIND_GRPC: return "grpc";
    case v1::TRANSPORT_KIND_INPROC: return "inproc";
    default: return "unspecified";
  }
}

absl::string_view RegionPurposeName(v1::RegionPurpose purpose) {
  switch (purpose) {
    case v1::REGION_PURPOSE_GRAD_STAGING: return "GRAD_STAGING";
    case v1::REGION_PURPOSE_PARAM_MASTER: return "PARAM_MASTER";
    case v1::REGION_PURPOSE_PARAM_HALF: return "PARAM_HALF";
    case v1::REGION_PURPOSE_ACTIVATION_ARENA: return "ACTIVATION_ARENA";
    default: return "UNSPECIFIED";
  }
}

}  // namespace zeroshard
