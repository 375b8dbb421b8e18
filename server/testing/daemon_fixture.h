#pragma once

// Test helpers: in-process daemons on 127.0.0.1:0, job specs built from a
// layout, and thin synchronous wrappers over the daemon's RPCs.

#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "common/layout.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/checkpoint.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "server/daemon.h"

namespace zeroshard::testing {

// The incarnation the helpers below join and push as.
inline constexpr uint64_t kTestIncarnation = 1;

// The job token DaemonClient sends by default (every test job's secret).
inline constexpr char kTestToken[] = "zeroshard-test-job-token";

// A fp32 AdamW job spec over `layout`, with the given daemons.
v1::JobSpec MakeSpec(const std::string& job_id, const Layout& layout, uint32_t stage,
                     uint32_t world_size, const std::vector<std::string>& daemons);

// A layout of a few tensors of awkward sizes (none divisible by common N_d)
// over three layers, one much larger than the others.
Layout SampleLayout();

// Stubs over one plaintext channel whose calls carry `token` (none when
// empty).
struct DaemonClient {
  explicit DaemonClient(const std::string& address, const std::string& token = kTestToken);
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> control;
  std::unique_ptr<v1::Shard::Stub> shard;
  std::unique_ptr<v1::Admin::Stub> admin;
  std::unique_ptr<v1::Checkpoint::Stub> checkpoint;

  grpc::Status Register(const v1::JobSpec& spec, uint32_t daemon_index,
                        v1::RegisterJobResponse* resp = nullptr);
  // Joins as `incarnation` (with the spec's precision).
  grpc::Status Join(const v1::JobSpec& spec, uint32_t rank, uint64_t incarnation = kTestIncarnation,
                    v1::JoinJobResponse* resp = nullptr);
  // Joins every rank of the job.
  grpc::Status JoinAll(const v1::JobSpec& spec);
  // With wait_for_step: a long poll of up to wait_ms for that commit.
  grpc::Status StepState(const std::string& job, v1::StepState* state, uint64_t wait_for_step = 0,
                         uint32_t wait_ms = 0);
  grpc::Status Push(const std::vector<v1::GradientChunk>& chunks,
                    v1::PushGradientResponse* resp = nullptr);
  grpc::Status Init(const std::vector<v1::ParameterChunk>& chunks);
  // Gathers `range` as fp32 (or `dtype`) after `after_step`.
  grpc::Status Gather(const std::string& job, uint64_t after_step, FlatRange range,
                      std::vector<float>* out, uint32_t wait_ms = 5000,
                      v1::DType dtype = v1::DTYPE_FP32);
  // Shard.Gather: every chunk of the answer, as it came.
  grpc::Status Gather(const v1::GatherRequest& request, std::vector<v1::ParameterChunk>* chunks);
  // Control.Leave as `rank` (kTestIncarnation).
  grpc::Status Leave(const std::string& job, uint32_t rank, uint64_t unreported_read_bytes = 0,
                     v1::LeaveResponse* resp = nullptr);
  grpc::Status Prepare(const std::string& job, uint64_t step, v1::PrepareStepResponse* resp);
  // As the leader (rank 0, kTestIncarnation).
  grpc::Status Commit(const std::string& job, uint64_t step, float lr, float clip = 1.0f,
                      bool skip = false, v1::CommitStepResponse* resp = nullptr);
  // Shard.ReadState: every chunk of the answer, as it came.
  grpc::Status ReadState(const v1::ReadStateRequest& request, std::vector<v1::StateChunk>* chunks);
  // ReadState of `array` over `range` as `rank` (kTestIncarnation): the
  // values into *out, the first chunk's update counts into *steps (if set).
  grpc::Status ReadState(const std::string& job, uint32_t rank, v1::StateArray array,
                         FlatRange range, std::vector<float>* out,
                         std::vector<v1::TensorStep>* steps = nullptr);
  // Shard.WriteState with `chunks` as one stream.
  grpc::Status WriteState(const std::vector<v1::StateChunk>& chunks,
                          v1::WriteStateResponse* resp = nullptr);
};

// A WriteState chunk of `array` over `range` holding `values`
// (range.size() floats; none for an empty range), as `rank`
// (kTestIncarnation), with its CRC-32C.
v1::StateChunk StateChunk(const std::string& job, uint32_t rank, v1::StateArray array,
                          FlatRange range, const float* values);

// Marks, in each chunk, the tensors of `tensors` (layout indices, ascending)
// that overlap its range as having no gradient (GradientChunk.no_grad_tensors).
void MarkNoGrad(const Layout& layout, const std::vector<uint32_t>& tensors,
                std::vector<v1::GradientChunk>* chunks);

// fp32 gradient chunks of `values` (flat, indexed from range.begin) for one
// rank, cut at `chunk_elements` and at partition boundaries of `map`.
std::vector<v1::GradientChunk> GradientChunks(const std::string& job, uint64_t step,
                                              uint32_t rank, const PartitionMap& map,
                                              FlatRange range, const float* values,
                                              uint64_t chunk_elements);

// Runs `call`, expects `code` and a message containing `text`, and that
// neither job `job`'s state (Job::StateHash) nor the daemon's ledger changed.
void ExpectRejected(Daemon& daemon, const std::string& job, grpc::StatusCode code,
                    const std::string& text, const std::function<grpc::Status()>& call);

// The daemon's zeroshard_requests_total{rpc=`rpc`, code=`code`}: the calls
// of that method it answered with that code.
double RequestCount(const Daemon& daemon, const std::string& rpc, const std::string& code = "OK");

// Starts a daemon with default options and `memory_limit`, writing
// checkpoints under `checkpoint_dir` (empty: none).
std::unique_ptr<Daemon> StartDaemon(uint64_t memory_limit = 0, int optimizer_threads = 1,
                                    const std::string& checkpoint_dir = "");


// Normal(0, scale) values.
std::vector<float> RandomVector(std::mt19937& rng, size_t n, float scale);

// fp32 parameter chunks of `values` (flat, indexed from range.begin).
std::vector<v1::ParameterChunk> ParamChunks(const std::string& job, FlatRange range,
                                            const float* values);

// A job over several in-process daemons (SampleLayout), every rank joined,
// driven the way the client library drives it: every rank pushes its
// gradient slices to the owning daemons; the leader prepares on every
// daemon, combines the norms, clips and commits.
class TestCluster {
 public:
  // With `state_dir`, daemon d keeps the job's masters and moments in
  // `state_dir`/d<d> (DaemonOptions::state_dir, no state memory), in chunks
  // of `state_chunk_elements`, and with `state_gradients` its gradient
  // accumulator as a file mapping there.
  // `customize`, if set, changes each daemon's options before it starts.
  TestCluster(int num_daemons, uint32_t world, uint32_t stage, const std::string& job,
              const std::string& checkpoint_dir = "",
              v1::DType precision = v1::DTYPE_FP32, bool node_cache = false,
              const std::string& state_dir = "", uint64_t state_chunk_elements = 1024,
              bool state_gradients = false,
              const std::function<void(DaemonOptions&)>& customize = nullptr);

  uint64_t total() const { return config_.map.total_elements(); }
  const PartitionMap& map() const { return config_.map; }
  DaemonClient& client(int d) { return *clients_[d]; }
  Daemon& daemon(int d) { return *daemons_[d]; }
  int num_daemons() const { return static_cast<int>(daemons_.size()); }
  const std::string& job() const { return job_; }
  const v1::JobSpec& spec() const { return spec_; }
  // Daemon d's elements below total().
  FlatRange DaemonRange(int d) const;

  void Init(const std::vector<float>& params);
  // Rank `rank`'s chunks of `grad` (the whole flat gradient) for daemon d.
  std::vector<v1::GradientChunk> RankChunks(uint64_t step, uint32_t rank, int d,
                                            const std::vector<float>& grad);
  // Pushes `grads[r]` for every rank r to every daemon (EXPECTs success),
  // every rank marking the tensors `no_grad` as without a gradient.
  void PushAll(uint64_t step, const std::vector<std::vector<float>>& grads,
               const std::vector<uint32_t>& no_grad = {});
  // Prepares and commits `step`; returns the clip coefficient used.
  float Step(uint64_t step, float lr, float max_norm);
  std::vector<float> GatherAll(uint64_t after_step);
  // The same as `dtype` (values converted to float).
  std::vector<float> GatherAll(uint64_t after_step, v1::DType dtype);
  // A whole checkpoint `name` of committed step `step` on every daemon
  // (SaveCheckpoint, the writes awaited, CompleteCheckpoint); EXPECTs
  // success.
  void SaveCheckpoint(const std::string& name, uint64_t step);
  // LoadCheckpoint of `name` on every daemon; the first error, if any.
  grpc::Status LoadCheckpoint(const std::string& name);
  // Every trainable tensor's update count, as the daemons answer ReadState
  // (EXPECTs the daemons holding a tensor to agree).
  std::map<uint32_t, uint64_t> TensorSteps();

 private:
  Layout layout_;
  std::string job_;
  uint32_t world_;
  v1::JobSpec spec_;
  JobConfig config_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<std::unique_ptr<DaemonClient>> clients_;
};

}  // namespace zeroshard::testing
