#include "server/testing/daemon_fixture.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/channel.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/protocol.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"

namespace zeroshard::testing {

v1::JobSpec MakeSpec(const std::string& job_id, const Layout& layout, uint32_t stage,
                     uint32_t world_size, const std::vector<std::string>& daemons) {
  v1::JobSpec spec;
  spec.set_job_id(job_id);
  *spec.mutable_layout() = LayoutToProto(layout);
  spec.set_layout_fingerprint(layout.fingerprint());
  spec.set_stage(stage);
  spec.set_world_size(world_size);
  spec.set_precision(v1::DTYPE_FP32);
  spec.set_reduction(v1::REDUCTION_MODE_DAEMON);
  v1::OptimizerConfig* o = spec.mutable_optimizer();
  o->set_kind(v1::OPTIMIZER_KIND_ADAMW);
  o->set_lr(1e-2f);
  o->set_beta1(0.9f);
  o->set_beta2(0.999f);
  o->set_eps(1e-8f);
  o->set_weight_decay(0.01f);
  spec.set_bucket_bytes(64 << 10);
  for (const auto& d : daemons) spec.add_daemons(d);
  return spec;
}

Layout SampleLayout() {
  return *Layout::Create({{"embed", {97, 13}, DType::kFp32, 0},
                          {"l1.w", {13, 13}, DType::kFp32, 1},
                          {"l1.b", {13}, DType::kFp32, 1},
                          {"big.w", {211, 37}, DType::kFp32, 2},
                          {"big.b", {37}, DType::kFp32, 2},
                          {"head", {5, 3}, DType::kFp32, 3}});
}

DaemonClient::DaemonClient(const std::string& address, const std::string& token) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  channel = MakeChannel(address, ChannelSecurity::Plaintext(token), args);
  control = v1::Control::NewStub(channel);
  shard = v1::Shard::NewStub(channel);
  admin = v1::Admin::NewStub(channel);
  checkpoint = v1::Checkpoint::NewStub(channel);
}

namespace {
void SetDeadline(grpc::ClientContext* ctx, int seconds = 30) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}
}  // namespace

grpc::Status DaemonClient::Register(const v1::JobSpec& spec, uint32_t daemon_index,
                                    v1::RegisterJobResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::RegisterJobRequest req;
  *req.mutable_spec() = spec;
  req.set_daemon_index(daemon_index);
  v1::RegisterJobResponse local;
  return control->RegisterJob(&ctx, req, resp ? resp : &local);
}

grpc::Status DaemonClient::Join(const v1::JobSpec& spec, uint32_t rank, uint64_t incarnation,
                                v1::JoinJobResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::JoinJobRequest req;
  req.set_job_id(spec.job_id());
  req.set_rank(rank);
  req.set_layout_fingerprint(spec.layout_fingerprint());
  req.set_stage(spec.stage());
  req.set_world_size(spec.world_size());
  req.set_precision(spec.precision());
  req.set_incarnation(incarnation);
  v1::JoinJobResponse local;
  return control->JoinJob(&ctx, req, resp ? resp : &local);
}

grpc::Status DaemonClient::Push(const std::vector<v1::GradientChunk>& chunks,
                                v1::PushGradientResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::PushGradientResponse local;
  auto writer = shard->PushGradient(&ctx, resp ? resp : &local);
  for (const auto& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status DaemonClient::Init(const std::vector<v1::ParameterChunk>& chunks) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::InitParametersResponse resp;
  auto writer = shard->InitParameters(&ctx, &resp);
  for (const auto& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status DaemonClient::Gather(const std::string& job, uint64_t after_step, FlatRange range,
                                  std::vector<float>* out, uint32_t wait_ms, v1::DType dtype) {
  v1::GatherRequest req;
  req.set_job_id(job);
  req.set_after_step(after_step);
  req.mutable_range()->set_begin(range.begin);
  req.mutable_range()->set_end(range.end);
  req.set_dtype(dtype);
  req.set_wait_ms(wait_ms);
  std::vector<v1::ParameterChunk> chunks;
  grpc::Status s = Gather(req, &chunks);
  out->clear();
  for (const v1::ParameterChunk& chunk : chunks) {
    const size_t n = chunk.range().end() - chunk.range().begin();
    const size_t old = out->size();
    out->resize(old + n);
    ToFloat(static_cast<DType>(chunk.dtype()), chunk.data().data(), out->data() + old, n);
  }
  return s;
}

grpc::Status DaemonClient::Gather(const v1::GatherRequest& request,
                                  std::vector<v1::ParameterChunk>* chunks) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  auto reader = shard->Gather(&ctx, request);
  chunks->clear();
  v1::ParameterChunk chunk;
  while (reader->Read(&chunk)) chunks->push_back(chunk);
  return reader->Finish();
}

grpc::Status DaemonClient::Leave(const std::string& job, uint32_t rank,
                                 uint64_t unreported_read_bytes, v1::LeaveResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::LeaveRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_incarnation(kTestIncarnation);
  req.set_unreported_read_bytes(unreported_read_bytes);
  v1::LeaveResponse ignored;
  return control->Leave(&ctx, req, resp != nullptr ? resp : &ignored);
}

grpc::Status DaemonClient::Prepare(const std::string& job, uint64_t step,
                                   v1::PrepareStepResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::PrepareStepRequest req;
  req.set_job_id(job);
  req.set_step(step);
  req.set_rank(0);
  req.set_incarnation(kTestIncarnation);
  return shard->PrepareStep(&ctx, req, resp);
}

grpc::Status DaemonClient::Commit(const std::string& job, uint64_t step, float lr, float clip,
                                  bool skip, v1::CommitStepResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::CommitStepRequest req;
  req.set_job_id(job);
  req.set_step(step);
  req.set_lr(lr);
  req.set_clip_coef(clip);
  req.set_skip(skip);
  req.set_rank(0);
  req.set_incarnation(kTestIncarnation);
  v1::CommitStepResponse local;
  return shard->CommitStep(&ctx, req, resp ? resp : &local);
}

grpc::Status DaemonClient::ReadState(const v1::ReadStateRequest& request,
                                     std::vector<v1::StateChunk>* chunks) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  auto reader = shard->ReadState(&ctx, request);
  chunks->clear();
  v1::StateChunk chunk;
  while (reader->Read(&chunk)) chunks->push_back(chunk);
  return reader->Finish();
}

grpc::Status DaemonClient::ReadState(const std::string& job, uint32_t rank, v1::StateArray array,
                                     FlatRange range, std::vector<float>* out,
                                     std::vector<v1::TensorStep>* steps) {
  v1::ReadStateRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_incarnation(kTestIncarnation);
  req.set_array(array);
  req.mutable_range()->set_begin(range.begin);
  req.mutable_range()->set_end(range.end);
  std::vector<v1::StateChunk> chunks;
  grpc::Status s = ReadState(req, &chunks);
  out->clear();
  if (steps != nullptr) steps->clear();
  for (size_t i = 0; i < chunks.size(); ++i) {
    const v1::StateChunk& c = chunks[i];
    EXPECT_EQ(c.range().begin(), range.begin + out->size()) << "chunk " << i;
    EXPECT_EQ(c.data().size(), (c.range().end() - c.range().begin()) * sizeof(float));
    EXPECT_EQ(c.crc32c(), Crc32c(c.data().data(), c.data().size())) << "chunk " << i;
    if (i > 0) EXPECT_EQ(c.tensor_steps_size(), 0) << "chunk " << i;
    const size_t old = out->size();
    out->resize(old + c.data().size() / sizeof(float));
    std::memcpy(out->data() + old, c.data().data(), c.data().size());
    if (steps != nullptr && i == 0) steps->assign(c.tensor_steps().begin(), c.tensor_steps().end());
  }
  return s;
}

grpc::Status DaemonClient::WriteState(const std::vector<v1::StateChunk>& chunks,
                                      v1::WriteStateResponse* resp) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::WriteStateResponse local;
  auto writer = shard->WriteState(&ctx, resp ? resp : &local);
  for (const auto& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

v1::StateChunk StateChunk(const std::string& job, uint32_t rank, v1::StateArray array,
                          FlatRange range, const float* values) {
  v1::StateChunk c;
  c.set_job_id(job);
  c.set_rank(rank);
  c.set_incarnation(kTestIncarnation);
  c.set_array(array);
  c.mutable_range()->set_begin(range.begin);
  c.mutable_range()->set_end(range.end);
  if (!range.empty()) {
    c.set_data(reinterpret_cast<const char*>(values), range.size() * sizeof(float));
    c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
  }
  return c;
}

void MarkNoGrad(const Layout& layout, const std::vector<uint32_t>& tensors,
                std::vector<v1::GradientChunk>* chunks) {
  for (v1::GradientChunk& c : *chunks) {
    c.clear_no_grad_tensors();
    const auto [first, last] = layout.TensorsIn({c.range().begin(), c.range().end()});
    for (uint32_t t : tensors) {
      if (t >= first && t < last) c.add_no_grad_tensors(t);
    }
  }
}

std::vector<v1::GradientChunk> GradientChunks(const std::string& job, uint64_t step,
                                              uint32_t rank, const PartitionMap& map,
                                              FlatRange range, const float* values,
                                              uint64_t chunk_elements) {
  std::vector<v1::GradientChunk> out;
  auto pieces = map.Split(range);
  EXPECT_TRUE(pieces.ok());
  for (const auto& piece : *pieces) {
    for (uint64_t b = piece.range.begin; b < piece.range.end; b += chunk_elements) {
      const uint64_t e = std::min(piece.range.end, b + chunk_elements);
      v1::GradientChunk c;
      c.set_job_id(job);
      c.set_step(step);
      c.set_rank(rank);
      c.set_incarnation(kTestIncarnation);
      c.mutable_range()->set_begin(b);
      c.mutable_range()->set_end(e);
      c.set_dtype(v1::DTYPE_FP32);
      c.set_data(reinterpret_cast<const char*>(values + (b - range.begin)), (e - b) * 4);
      c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
      out.push_back(std::move(c));
    }
  }
  return out;
}

grpc::Status DaemonClient::JoinAll(const v1::JobSpec& spec) {
  for (uint32_t r = 0; r < spec.world_size(); ++r) {
    grpc::Status s = Join(spec, r);
    if (!s.ok()) return s;
  }
  return grpc::Status::OK;
}

grpc::Status DaemonClient::StepState(const std::string& job, v1::StepState* state,
                                     uint64_t wait_for_step, uint32_t wait_ms) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetStepStateRequest req;
  req.set_job_id(job);
  req.set_wait_for_step(wait_for_step);
  req.set_wait_ms(wait_ms);
  return shard->GetStepState(&ctx, req, state);
}

double RequestCount(const Daemon& daemon, const std::string& rpc, const std::string& code) {
  return metrics::SumOf(daemon.registry().Collect(), metrics::kRequestsTotal.name,
                        {{"rpc", rpc}, {"code", code}});
}

void ExpectRejected(Daemon& daemon, const std::string& job, grpc::StatusCode code,
                    const std::string& text, const std::function<grpc::Status()>& call) {
  auto hash = [&] { return (*daemon.jobs().Find(job))->StateHash(); };
  const uint64_t before = hash();
  const uint64_t ledger_before = daemon.ledger().total();
  grpc::Status s = call();
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(text), std::string::npos)
      << "message \"" << s.error_message() << "\" lacks \"" << text << "\"";
  EXPECT_EQ(hash(), before) << "state changed by a rejected request: " << s.error_message();
  // A stream the client cancelled can end on the client before the daemon's
  // handler has let go of what it held: give the handler a moment.
  const absl::Time settle = absl::Now() + absl::Seconds(5);
  while (daemon.ledger().total() != ledger_before && absl::Now() < settle) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(daemon.ledger().total(), ledger_before);
}

std::unique_ptr<Daemon> StartDaemon(uint64_t memory_limit, int optimizer_threads,
                                    const std::string& checkpoint_dir) {
  DaemonOptions options;
  options.checkpoint_dir = checkpoint_dir;
  options.listen = "127.0.0.1:0";
  options.memory_limit_bytes = memory_limit;
  options.optimizer_threads = optimizer_threads;
  options.read_lease = absl::ZeroDuration();  // removed jobs are freed at the next reap
  auto d = Daemon::Start(options);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}


std::vector<float> RandomVector(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<v1::ParameterChunk> ParamChunks(const std::string& job, FlatRange range,
                                            const float* values) {
  std::vector<v1::ParameterChunk> out;
  for (uint64_t b = range.begin; b < range.end; b += 1000) {
    const uint64_t e = std::min(range.end, b + 1000);
    v1::ParameterChunk c;
    c.set_job_id(job);
    c.mutable_range()->set_begin(b);
    c.mutable_range()->set_end(e);
    c.set_dtype(v1::DTYPE_FP32);
    c.set_data(reinterpret_cast<const char*>(values + (b - range.begin)), (e - b) * 4);
    out.push_back(std::move(c));
  }
  return out;
}

TestCluster::TestCluster(int num_daemons, uint32_t world, uint32_t stage, const std::string& job,
                         const std::string& checkpoint_dir, v1::DType precision,
                         bool node_cache, const std::string& state_dir,
                         uint64_t state_chunk_elements, bool state_gradients,
                         const std::function<void(DaemonOptions&)>& customize)
    : layout_(SampleLayout()), job_(job), world_(world) {
  std::vector<std::string> addresses;
  for (int i = 0; i < num_daemons; ++i) {
    DaemonOptions options;
    options.checkpoint_dir = checkpoint_dir;
    options.listen = "127.0.0.1:0";
    options.optimizer_threads = 1;
    options.read_lease = absl::ZeroDuration();
    if (!state_dir.empty()) {
      options.state_dir = absl::StrCat(state_dir, "/d", i);
      options.state_chunk_elements = state_chunk_elements;
      options.state_gradients = state_gradients;
    }
    if (customize) customize(options);
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
    EXPECT_TRUE(d.ok()) << d.status();
    daemons_.push_back(d.ok() ? *std::move(d) : nullptr);
    addresses.push_back(daemons_.back()->address());
  }
  spec_ = MakeSpec(job, layout_, stage, world, addresses);
  spec_.set_precision(precision);
  spec_.set_node_cache(node_cache);
  config_ = *ParseJobSpec(spec_);
  for (int i = 0; i < num_daemons; ++i) {
    clients_.push_back(std::make_unique<DaemonClient>(addresses[i]));
    EXPECT_TRUE(clients_[i]->Register(spec_, i).ok());
    for (uint32_t r = 0; r < world; ++r) EXPECT_TRUE(clients_[i]->Join(spec_, r).ok());
  }
}

FlatRange TestCluster::DaemonRange(int d) const {
  return config_.map.DaemonRange(d).Intersect({0, total()});
}

void TestCluster::Init(const std::vector<float>& params) {
  for (int d = 0; d < num_daemons(); ++d) {
    const FlatRange r = DaemonRange(d);
    grpc::Status s = client(d).Init(ParamChunks(job_, r, params.data() + r.begin));
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
}

std::vector<v1::GradientChunk> TestCluster::RankChunks(uint64_t step, uint32_t rank, int d,
                                                       const std::vector<float>& grad) {
  const FlatRange r = DaemonRange(d);
  return GradientChunks(job_, step, rank, config_.map, r, grad.data() + r.begin, 333);
}

void TestCluster::PushAll(uint64_t step, const std::vector<std::vector<float>>& grads,
                          const std::vector<uint32_t>& no_grad) {
  for (uint32_t rank = 0; rank < grads.size(); ++rank) {
    for (int d = 0; d < num_daemons(); ++d) {
      std::vector<v1::GradientChunk> chunks = RankChunks(step, rank, d, grads[rank]);
      MarkNoGrad(layout_, no_grad, &chunks);
      grpc::Status s = client(d).Push(chunks);
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
  }
}

float TestCluster::Step(uint64_t step, float lr, float max_norm) {
  double sum_sq = 0;
  for (int d = 0; d < num_daemons(); ++d) {
    v1::PrepareStepResponse p;
    grpc::Status s = client(d).Prepare(job_, step, &p);
    EXPECT_TRUE(s.ok()) << s.error_message();
    sum_sq += p.grad_sq_sum();
  }
  const float norm = static_cast<float>(std::sqrt(sum_sq));
  const float clip = std::min(1.0f, max_norm / (norm + 1e-6f));
  for (int d = 0; d < num_daemons(); ++d) {
    grpc::Status s = client(d).Commit(job_, step, lr, clip);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  return clip;
}

std::vector<float> TestCluster::GatherAll(uint64_t after_step) {
  return GatherAll(after_step, v1::DTYPE_FP32);
}

void TestCluster::SaveCheckpoint(const std::string& name, uint64_t step) {
  std::vector<v1::PartManifest> parts;
  for (int d = 0; d < num_daemons(); ++d) {
    v1::SaveCheckpointRequest req;
    req.set_job_id(job_);
    req.set_name(name);
    req.set_step(step);
    v1::SaveCheckpointResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = client(d).checkpoint->SaveCheckpoint(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  for (int d = 0; d < num_daemons(); ++d) {
    v1::GetCheckpointStatusRequest req;
    req.set_job_id(job_);
    req.set_name(name);
    req.set_wait_ms(30000);
    v1::CheckpointStatus st;
    grpc::ClientContext ctx;
    grpc::Status s = client(d).checkpoint->GetCheckpointStatus(&ctx, req, &st);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(st.state(), v1::CheckpointStatus::STATE_WRITTEN) << st.error();
    parts.push_back(st.part());
  }
  for (int d = 0; d < num_daemons(); ++d) {
    v1::CompleteCheckpointRequest req;
    req.set_job_id(job_);
    req.set_name(name);
    for (const v1::PartManifest& p : parts) *req.add_parts() = p;
    v1::CompleteCheckpointResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = client(d).checkpoint->CompleteCheckpoint(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
}

grpc::Status TestCluster::LoadCheckpoint(const std::string& name) {
  for (int d = 0; d < num_daemons(); ++d) {
    v1::LoadCheckpointRequest req;
    req.set_job_id(job_);
    req.set_name(name);
    v1::LoadCheckpointResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = client(d).checkpoint->LoadCheckpoint(&ctx, req, &resp);
    if (!s.ok()) return s;
  }
  return grpc::Status::OK;
}

std::vector<float> TestCluster::GatherAll(uint64_t after_step, v1::DType dtype) {
  std::vector<float> out(total());
  for (int d = 0; d < num_daemons(); ++d) {
    const FlatRange r = DaemonRange(d);
    std::vector<float> part;
    grpc::Status s = client(d).Gather(job_, after_step, r, &part, 5000, dtype);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(part.size(), r.size());
    std::copy(part.begin(), part.end(), out.begin() + r.begin);
  }
  return out;
}

std::map<uint32_t, uint64_t> TestCluster::TensorSteps() {
  std::map<uint32_t, uint64_t> out;
  for (int d = 0; d < num_daemons(); ++d) {
    std::vector<float> values;
    std::vector<v1::TensorStep> steps;
    grpc::Status s =
        client(d).ReadState(job_, 0, v1::STATE_ARRAY_MASTER, DaemonRange(d), &values, &steps);
    EXPECT_TRUE(s.ok()) << s.error_message();
    for (const v1::TensorStep& t : steps) {
      auto [it, inserted] = out.emplace(t.tensor(), t.steps());
      EXPECT_EQ(it->second, t.steps()) << "daemons disagree on tensor " << t.tensor();
    }
  }
  return out;
}

}  // namespace zeroshard::testing
