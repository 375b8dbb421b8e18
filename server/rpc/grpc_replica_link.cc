#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/channel.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "server/rpc/grpc_replica_link.h"

namespace zeroshard {
namespace {

absl::Status PeerError(const grpc::Status& s, const std::string& peer, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, " on the peer daemon ", peer, ": ", s.error_message()));
}

void Prepare(grpc::ClientContext* context, const std::string& token, absl::Time deadline) {
  context->set_deadline(absl::ToChronoTime(deadline));
  if (!token.empty()) {
    context->AddMetadata(kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, token));
  }
}

// Writes the chunks `next` fills, then finishes the stream.
template <typename Chunk, typename Response>
absl::Status WriteStream(grpc::ClientWriter<Chunk>* writer, grpc::ClientContext* context,
                         absl::FunctionRef<bool(Chunk*)> next, const std::string& peer,
                         absl::string_view what) {
  Chunk chunk;
  while (next(&chunk)) {
    if (!writer->Write(chunk)) break;  // the peer ended the stream: Finish says why
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return PeerError(s, peer, what);
  return absl::OkStatus();
}

}  // namespace

absl::Status GrpcReplicaLink::Checked(const std::string& peer, absl::Status s) {
  if (absl::IsUnavailable(s)) channels_.Drop(peer);
  return s;
}

absl::Status GrpcReplicaLink::RegisterBackup(const std::string& peer, const std::string& token,
                                             const v1::JobSpec& spec, uint32_t daemon_index,
                                             absl::Time deadline) {
  v1::RegisterJobRequest request;
  *request.mutable_spec() = spec;
  request.set_daemon_index(daemon_index);
  request.set_as_backup(true);
  v1::RegisterJobResponse response;
  return Unary(peer, token, deadline, "RegisterJob (as backup)",
               [&](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context) {
                 return v1::Control::NewStub(channel)->RegisterJob(context, request, &response);
               });
}

absl::StatusOr<v1::TransferStateResponse> GrpcReplicaLink::TransferState(
    const std::string& peer, const std::string& token,
    absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next, absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = channels_.Get(peer);
  if (!channel.ok()) return channel.status();
  grpc::ClientContext context;
  Prepare(&context, token, deadline);
  v1::TransferStateResponse response;
  auto stub = v1::Replica::NewStub(*channel);
  auto writer = stub->TransferState(&context, &response);
  absl::Status s = Checked(peer, WriteStream<v1::ReplicaStateChunk, v1::TransferStateResponse>(
                                     writer.get(), &context, next, peer, "TransferState"));
  if (!s.ok()) return s;
  return response;
}

absl::Status GrpcReplicaLink::ForwardGradient(
    const std::string& peer, const std::string& token,
    absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next, absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = channels_.Get(peer);
  if (!channel.ok()) return channel.status();
  grpc::ClientContext context;
  Prepare(&context, token, deadline);
  v1::ForwardGradientResponse response;
  auto stub = v1::Replica::NewStub(*channel);
  auto writer = stub->ForwardGradient(&context, &response);
  return Checked(peer, WriteStream<v1::ForwardedGradientChunk, v1::ForwardGradientResponse>(
                           writer.get(), &context, next, peer, "ForwardGradient"));
}

absl::Status GrpcReplicaLink::CommitReplica(const std::string& peer, const std::string& token,
                                            const v1::CommitReplicaRequest& request,
                                            absl::Time deadline) {
  v1::CommitStepResponse response;
  return Unary(peer, token, deadline, "CommitReplica",
               [&](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context) {
                 return v1::Replica::NewStub(channel)->CommitReplica(context, request, &response);
               });
}

absl::Status GrpcReplicaLink::ReleaseReplica(const std::string& peer, const std::string& token,
                                             const v1::ReleaseReplicaRequest& request,
                                             absl::Time deadline) {
  v1::ReleaseReplicaResponse response;
  return Unary(peer, token, deadline, "ReleaseReplica",
               [&](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context) {
                 return v1::Replica::NewStub(channel)->ReleaseReplica(context, request, &response);
               });
}

absl::Status GrpcReplicaLink::Unary(
    const std::string& peer, const std::string& token, absl::Time deadline, absl::string_view what,
    absl::FunctionRef<grpc::Status(const std::shared_ptr<grpc::Channel>&, grpc::ClientContext*)>
        call) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = channels_.Get(peer);
  if (!channel.ok()) return channel.status();
  grpc::ClientContext context;
  Prepare(&context, token, deadline);
  const grpc::Status s = call(*channel, &context);
  if (!s.ok()) return Checked(peer, PeerError(s, peer, what));
  return absl::OkStatus();
}

absl::Status GrpcReplicaLink::Probe(const std::string& peer, absl::Time deadline) {
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  return Unary(peer, "", deadline, "Health.Check",
               [&](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context) {
                 return grpc::health::v1::Health::NewStub(channel)->Check(context, request,
                                                                          &response);
               });
}

absl::StatusOr<v1::ReplicaState> GrpcReplicaLink::GetReplicaState(const std::string& peer,
                                                                  const std::string& token,
                                                                  const std::string& job_id,
                                                                  absl::Time deadline) {
  v1::GetReplicaStateRequest request;
  request.set_job_id(job_id);
  v1::ReplicaState response;
  absl::Status s = Unary(
      peer, token, deadline, "GetReplicaState",
      [&](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context) {
        return v1::Replica::NewStub(channel)->GetReplicaState(context, request, &response);
      });
  if (!s.ok()) return s;
  return response;
}

}  // namespace zeroshard
