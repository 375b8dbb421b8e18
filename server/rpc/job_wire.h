#pragma once

// The wire form of what a Job takes and answers: the services decode the
// requests' messages into the plain structs of server/job, server/step,
// server/checkpoint and server/replica, and encode the answers, here and
// nowhere below. Decoding copies no payload: a chunk's data is viewed in
// its message, which must outlive the struct.

#include <vector>

#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "proto/zeroshard/v1/control.pb.h"
#include "proto/zeroshard/v1/replica.pb.h"
#include "proto/zeroshard/v1/shard.pb.h"
#include "server/checkpoint/checkpoint_agent.h"
#include "server/job/job.h"
#include "server/replica/replica_group.h"
#include "server/step/step_types.h"

namespace zeroshard {

JoinRequest FromWire(const v1::JoinJobRequest& r);
void ToWire(const JoinResult& r, v1::JoinJobResponse* out);

ParameterChunkIn FromWire(const v1::ParameterChunk& c);
// The payload is the chunk's data (an inline push); a staged push points
// it into the staging slot afterwards.
GradientChunkIn FromWire(const v1::GradientChunk& c);
StateChunkIn FromWire(const v1::StateChunk& c);
template <typename Message>
auto FromWire(const std::vector<Message>& chunks) {
  std::vector<decltype(FromWire(chunks[0]))> out;
  out.reserve(chunks.size());
  for (const Message& c : chunks) out.push_back(FromWire(c));
  return out;
}
CommitRequest FromWire(const v1::CommitStepRequest& r);

void ToWire(const PushResult& r, v1::PushGradientResponse* out);
void ToWire(const PrepareResult& r, v1::PrepareStepResponse* out);
void ToWire(const CommitResult& r, v1::CommitStepResponse* out);
void ToWire(const WriteStateResult& r, v1::WriteStateResponse* out);
void ToWire(const JobStepState& s, v1::StepState* out);
void ToWire(const ReplicaGroupStatus& s, v1::ReplicaGroupState* out);
// Adds the regions to the endpoint's.
void ToWire(const std::vector<ParameterRegion>& regions, v1::ExchangeEndpointResponse* out);
void ToWire(const CheckpointSaved& r, v1::SaveCheckpointResponse* out);
void ToWire(CheckpointProgress p, v1::CheckpointStatus* out);
void ToWire(const CheckpointLoaded& r, v1::LoadCheckpointResponse* out);

// Outgoing chunks: the chunk's data is swapped into the message and must be
// swapped back (SwapBack) once the message is written: no copy.
void SwapToWire(ParameterChunkOut& c, v1::ParameterChunk* out);
void SwapBack(v1::ParameterChunk* out, ParameterChunkOut& c);
void SwapToWire(StateChunkOut& c, v1::StateChunk* out);
void SwapBack(v1::StateChunk* out, StateChunkOut& c);

}  // namespace zeroshard
