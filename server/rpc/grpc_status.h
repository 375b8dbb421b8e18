#pragma once

// absl::Status -> grpc::Status, code for code, message unchanged.

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace zeroshard
