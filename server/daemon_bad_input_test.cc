// Bad input to every RPC of the daemon: each gets a specific status code and
// a message a person can act on, and the job's state (hashed) is unchanged.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "common/crc32c.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::GradientChunks;
using testing::MakeSpec;
using testing::SampleLayout;
using testing::StartDaemon;

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = StartDaemon(/*memory_limit=*/64 << 20);
    client_ = std::make_unique<DaemonClient>(daemon_->address());
    spec_ = MakeSpec("job", SampleLayout(), 2, kWorld, {daemon_->address()});
    config_ = *ParseJobSpec(spec_);
    ASSERT_TRUE(client_->Register(spec_, 0).ok());
    for (uint32_t r = 0; r < kWorld; ++r) ASSERT_TRUE(client_->Join(spec_, r).ok());
    grad_.assign(config_.map.total_elements(), 0.25f);
    // Rank 0 has pushed step 1 already: state with some reduction in flight.
    ASSERT_TRUE(client_->Push(Chunks(1, 0)).ok());
  }

  std::vector<v1::GradientChunk> Chunks(uint64_t step, uint32_t rank) {
    return GradientChunks("job", step, rank, config_.map, {0, config_.map.total_elements()},
                          grad_.data(), 500);
  }

  uint64_t Hash() { return (*daemon_->jobs().Find("job"))->StateHash(); }

  // Runs `call`, expects `code` and a message containing `text`, and that the
  // job's state did not change.
  template <typename Call>
  void ExpectRejected(grpc::StatusCode code, const std::string& text, Call call) {
    testing::ExpectRejected(*daemon_, "job", code, text, call);
  }

  // Job "sem": two parameter groups and a frozen tensor, over two daemons of
  // which this one (index 0) owns [0, 128) of 240 elements (aligned to 16):
  // w0 [0,70) group 0, frozen [80,100), w1 [112,172) group 1 (its first 16
  // elements here), w2 [176,236) group 1 (all on the other daemon). Both
  // ranks joined, masters initialised (zeros in the gaps).
  void RegisterSemantics() {
    std::vector<TensorSpec> specs = {{"w0", {70}, DType::kFp32, 0},
                                     {"frozen", {20}, DType::kFp32, 0},
                                     {"w1", {60}, DType::kFp32, 1},
                                     {"w2", {6, 10}, DType::kFp32, 1}};
    specs[1].frozen = true;
    specs[2].group = 1;
    specs[3].group = 1;
    sem_layout_ = *Layout::Create(specs, 16);
    sem_spec_ = MakeSpec("sem", sem_layout_, 2, 2, {daemon_->address(), "127.0.0.1:9"});
    for (int g = 0; g < 2; ++g) {
      v1::ParamGroup* pg = sem_spec_.add_param_groups();
      pg->set_lr(g == 0 ? 1e-2f : 5e-2f);
      pg->set_beta1(g == 0 ? 0.9f : 0.8f);
      pg->set_beta2(g == 0 ? 0.999f : 0.99f);
      pg->set_eps(1e-8f);
      pg->set_weight_decay(g == 0 ? 0.01f : 0.1f);
    }
    sem_config_ = *ParseJobSpec(sem_spec_);
    ASSERT_EQ(sem_config_.map.DaemonRange(0), (FlatRange{0, kSemOwned}));
    grpc::Status s = client_->Register(sem_spec_, 0);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(client_->JoinAll(sem_spec_).ok());
    sem_init_ = Masked(0.5f, false);
    ASSERT_TRUE(client_->Init(testing::ParamChunks("sem", {0, kSemOwned}, sem_init_.data())).ok());
  }

  // kSemOwned values (`base` + 0.01 * i) over this daemon's part of "sem",
  // zeros in the gaps and, when `moments`, in the frozen tensor.
  std::vector<float> Masked(float base, bool moments) const {
    std::vector<float> out(kSemOwned, 0.0f);
    for (const TensorPlacement& t : sem_layout_.tensors()) {
      if (moments && t.spec.frozen) continue;
      const FlatRange r = t.range().Intersect({0, kSemOwned});
      for (uint64_t i = r.begin; i < r.end; ++i) out[i] = base + 0.01f * static_cast<float>(i);
    }
    return out;
  }

  v1::StateChunk SemChunk(v1::StateArray array, FlatRange range, const float* values) {
    return testing::StateChunk("sem", 0, array, range, values);
  }

  // Both ranks push step `step` of "sem" (w1 without a gradient when
  // `w1_no_grad`) and it is prepared.
  void PrepareSemantics(uint64_t step, bool w1_no_grad = false) {
    const std::vector<float> grad = Masked(0.125f, false);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      std::vector<v1::GradientChunk> c =
          GradientChunks("sem", step, rank, sem_config_.map, {0, kSemOwned}, grad.data(), 50);
      if (w1_no_grad) testing::MarkNoGrad(sem_layout_, {2}, &c);
      grpc::Status s = client_->Push(c);
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    v1::PrepareStepResponse p;
    grpc::Status s = client_->Prepare("sem", step, &p);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  grpc::Status CommitGroups(const std::string& job, uint64_t step,
                            const std::vector<float>& group_lrs) {
    grpc::ClientContext ctx;
    v1::CommitStepRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_lr(0.1f);  // valid whatever group_lrs hold
    req.set_rank(0);
    req.set_incarnation(testing::kTestIncarnation);
    for (float lr : group_lrs) req.add_group_lrs(lr);
    v1::CommitStepResponse resp;
    return client_->shard->CommitStep(&ctx, req, &resp);
  }

  static constexpr uint32_t kWorld = 3;
  static constexpr uint64_t kSemOwned = 128;
  Layout sem_layout_;
  v1::JobSpec sem_spec_;
  JobConfig sem_config_;
  std::vector<float> sem_init_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> client_;
  v1::JobSpec spec_;
  JobConfig config_;
  std::vector<float> grad_;
};

TEST_F(BadInputTest, RegisterJob) {
  auto reg = [&](v1::JobSpec spec, uint32_t index = 0) {
    return [this, spec, index] { return client_->Register(spec, index); };
  };
  v1::JobSpec s = spec_;
  s.set_job_id("bad id!");
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.job_id", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.set_stage(0);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.stage", reg(s));
  s.set_stage(4);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.stage", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.set_world_size(0);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.world_size", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.set_layout_fingerprint(s.layout_fingerprint() + 1);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.layout_fingerprint", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.mutable_layout()->mutable_tensors(1)->set_shape(0, -4);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.layout.tensors[1].shape[0]", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.mutable_layout()->mutable_tensors(2)->set_dtype(static_cast<v1::DType>(9));
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.layout.tensors[2].dtype", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.set_precision(v1::DTYPE_UNSPECIFIED);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.precision", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.mutable_optimizer()->set_lr(-1);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.optimizer.lr", reg(s));
  s.mutable_optimizer()->set_lr(std::nanf(""));
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.optimizer.lr", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.mutable_optimizer()->set_beta1(1.5f);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.optimizer.beta1", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.mutable_optimizer()->set_eps(0);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.optimizer.eps", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_UNSPECIFIED);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.optimizer.kind", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.set_reduction(v1::REDUCTION_MODE_UNSPECIFIED);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.reduction", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.set_bucket_bytes(10);
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.bucket_bytes", reg(s));
  s = spec_;
  s.set_job_id("other");
  s.clear_daemons();
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.daemons", reg(s));
  s.add_daemons("no-port");
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.daemons[0]", reg(s));
  s = spec_;
  s.set_job_id("other");
  ExpectRejected(grpc::INVALID_ARGUMENT, "daemon_index", reg(s, 1));
  s = spec_;
  s.mutable_loss_scale()->set_dynamic(true);
  s.set_job_id("other");
  ExpectRejected(grpc::INVALID_ARGUMENT, "spec.loss_scale.growth_interval", reg(s));
  // The same job id with a different spec: the field and both values.
  s = spec_;
  s.set_stage(3);
  ExpectRejected(grpc::FAILED_PRECONDITION, "stage: registered 2, got 3", reg(s));
  s = spec_;
  s.mutable_optimizer()->set_lr(0.5f);
  ExpectRejected(grpc::FAILED_PRECONDITION, "optimizer", reg(s));
  // Over the memory limit: refused before any allocation.
  const Layout huge = *Layout::Create({{"w", {4096, 4096}, DType::kFp32, 0}});
  s = MakeSpec("huge", huge, 3, 1, {daemon_->address()});
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "--memory_limit", reg(s));
  EXPECT_FALSE(daemon_->jobs().Find("huge").ok());
  // Registering the identical spec again is fine and changes nothing.
  const uint64_t before = Hash();
  v1::RegisterJobResponse resp;
  ASSERT_TRUE(client_->Register(spec_, 0, &resp).ok());
  EXPECT_FALSE(resp.created());
  EXPECT_EQ(Hash(), before);
}

TEST_F(BadInputTest, JoinHeartbeatLeave) {
  ExpectRejected(grpc::NOT_FOUND, "not registered", [&] {
    v1::JobSpec s = spec_;
    s.set_job_id("nope");
    return client_->Join(s, 0);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank", [&] { return client_->Join(spec_, kWorld); });
  auto join = [&](auto mutate) {
    return [this, mutate] {
      grpc::ClientContext ctx;
      v1::JoinJobRequest req;
      req.set_incarnation(testing::kTestIncarnation);
      req.set_job_id("job");
      req.set_rank(1);
      req.set_layout_fingerprint(spec_.layout_fingerprint());
      req.set_stage(spec_.stage());
      req.set_world_size(kWorld);
      req.set_precision(spec_.precision());
      mutate(req);
      v1::JoinJobResponse resp;
      return client_->control->JoinJob(&ctx, req, &resp);
    };
  };
  ExpectRejected(grpc::FAILED_PRECONDITION, "layout_fingerprint",
                 join([](v1::JoinJobRequest& r) { r.set_layout_fingerprint(7); }));
  ExpectRejected(grpc::FAILED_PRECONDITION, "stage differs from the registered job (registered 2",
                 join([](v1::JoinJobRequest& r) { r.set_stage(1); }));
  ExpectRejected(grpc::FAILED_PRECONDITION, "world_size",
                 join([](v1::JoinJobRequest& r) { r.set_world_size(5); }));
  ExpectRejected(grpc::FAILED_PRECONDITION, "precision",
                 join([](v1::JoinJobRequest& r) { r.set_precision(v1::DTYPE_BF16); }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank", [&] {
    grpc::ClientContext ctx;
    v1::HeartbeatRequest req;
    req.set_incarnation(testing::kTestIncarnation);
    req.set_job_id("job");
    req.set_rank(99);
    v1::HeartbeatResponse resp;
    return client_->control->Heartbeat(&ctx, req, &resp);
  });
  ExpectRejected(grpc::NOT_FOUND, "not registered", [&] { return client_->Leave("nope", 0); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank", [&] { return client_->Leave("job", kWorld); });
  // A valid rank whose report of its reads is out of bounds stays joined.
  ExpectRejected(grpc::INVALID_ARGUMENT, "unreported_read_bytes: at most",
                 [&] { return client_->Leave("job", 0, uint64_t{1} << 41); });
  ExpectRejected(grpc::NOT_FOUND, "not registered", [&] {
    grpc::ClientContext ctx;
    v1::GetPartitionMapRequest req;
    req.set_job_id("nope");
    v1::PartitionMap resp;
    return client_->control->GetPartitionMap(&ctx, req, &resp);
  });
}

// In trainer-collective mode each rank pushes its own reduced partition and
// nothing else.
TEST_F(BadInputTest, PushGradientInTrainerCollectiveMode) {
  v1::JobSpec spec = spec_;
  spec.set_job_id("tc");
  spec.set_reduction(v1::REDUCTION_MODE_TRAINER_COLLECTIVE);
  ASSERT_TRUE(client_->Register(spec, 0).ok());
  for (uint32_t r = 0; r < kWorld; ++r) ASSERT_TRUE(client_->Join(spec, r).ok());
  const uint64_t edge = config_.map.partition_elements();
  auto chunk = [&](uint32_t rank, FlatRange range) {
    std::vector<v1::GradientChunk> c =
        GradientChunks("tc", 1, rank, config_.map, range, grad_.data() + range.begin, 500);
    return [this, c] { return client_->Push(c); };
  };
  auto rejected = [&](grpc::StatusCode code, const std::string& text, auto call) {
    testing::ExpectRejected(*daemon_, "tc", code, text, call);
  };
  rejected(grpc::INVALID_ARGUMENT, "only rank 0 pushes partition 0", chunk(1, {0, 8}));
  rejected(grpc::INVALID_ARGUMENT, "crosses the boundary of partition 0", [&] {
    std::vector<v1::GradientChunk> c =
        GradientChunks("tc", 1, 0, config_.map, {edge - 4, edge}, grad_.data() + edge - 4, 500);
    c[0].mutable_range()->set_end(edge + 4);
    c[0].set_data(std::string(32, '\0'));
    c[0].set_crc32c(0);
    return client_->Push(c);
  });
  EXPECT_TRUE(chunk(0, {0, 8})().ok());
}

TEST_F(BadInputTest, PushGradient) {
  auto push = [&](std::vector<v1::GradientChunk> chunks) {
    return [this, chunks] { return client_->Push(chunks); };
  };
  auto one = [&](auto mutate) {
    std::vector<v1::GradientChunk> c = Chunks(1, 1);
    mutate(c[0]);
    return c;
  };
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 push(one([](v1::GradientChunk& c) { c.set_job_id("nope"); })));
  ExpectRejected(grpc::FAILED_PRECONDITION, "computing step 1",
                 push(one([](v1::GradientChunk& c) { c.set_step(2); })));
  ExpectRejected(grpc::FAILED_PRECONDITION, "computing step 1",
                 push(one([](v1::GradientChunk& c) { c.set_step(0); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank",
                 push(one([](v1::GradientChunk& c) { c.set_rank(kWorld); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "dtype",
                 push(one([](v1::GradientChunk& c) { c.set_dtype(v1::DTYPE_UNSPECIFIED); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "dtype: must be fp32 or the job's precision",
                 push(one([](v1::GradientChunk& c) { c.set_dtype(v1::DTYPE_BF16); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "outside the partitions", push(one([&](v1::GradientChunk& c) {
                   c.mutable_range()->set_begin(config_.map.total_elements());
                   c.mutable_range()->set_end(config_.map.total_elements() + 10);
                 })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "empty",
                 push(one([](v1::GradientChunk& c) { c.mutable_range()->set_end(c.range().begin()); })));
  // Daemon reduction takes chunks across partition boundaries (the daemon
  // owns all three here), but every rank must cut them alike.
  ExpectRejected(grpc::FAILED_PRECONDITION, "overlaps the chunk",
                 push(one([&](v1::GradientChunk& c) {
                   const uint64_t edge = config_.map.partition_elements();
                   c.mutable_range()->set_begin(edge - 4);
                   c.mutable_range()->set_end(edge + 4);
                   c.set_data(std::string(32, '\0'));
                   c.set_crc32c(0);
                 })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "bytes, expected",
                 push(one([](v1::GradientChunk& c) { c.mutable_data()->resize(c.data().size() - 4); })));
  ExpectRejected(grpc::DATA_LOSS, "CRC-32C",
                 push(one([](v1::GradientChunk& c) { (*c.mutable_data())[3] ^= 1; })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "micro_batch",
                 push(one([](v1::GradientChunk& c) { c.set_micro_batch(1); })));
  // A duplicate of what rank 0 already pushed is never counted twice.
  ExpectRejected(grpc::ALREADY_EXISTS, "already pushed", push(Chunks(1, 0)));
  // A stream whose last chunk is bad applies none of its good chunks.
  std::vector<v1::GradientChunk> tail_bad = Chunks(1, 1);
  tail_bad.back().set_rank(77);
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank", push(tail_bad));
  // The same range twice within one stream.
  std::vector<v1::GradientChunk> twice = Chunks(1, 1);
  twice.push_back(twice.front());
  ExpectRejected(grpc::INVALID_ARGUMENT, "appears twice in one push", push(twice));
  // Chunk boundaries that differ from rank 0's.
  std::vector<v1::GradientChunk> shifted = GradientChunks(
      "job", 1, 1, config_.map, {0, config_.map.total_elements()}, grad_.data(), 499);
  ExpectRejected(grpc::FAILED_PRECONDITION, "same chunks", push(shifted));
  // Another micro-batch count than the stream's other chunks use.
  ExpectRejected(grpc::INVALID_ARGUMENT, "micro_batches", push(one([](v1::GradientChunk& c) {
                   c.set_micro_batches(2);
                 })));
  // Chunks of the stream naming another job.
  std::vector<v1::GradientChunk> mixed = Chunks(1, 1);
  mixed[1].set_job_id("zzz");
  ExpectRejected(grpc::INVALID_ARGUMENT, "job_id", push(mixed));
  // An empty stream.
  ExpectRejected(grpc::INVALID_ARGUMENT, "no chunk", push({}));
  // A client that vanishes mid-stream: nothing applied.
  ExpectRejected(grpc::CANCELLED, "", [&] {
    grpc::ClientContext ctx;
    v1::PushGradientResponse resp;
    auto writer = client_->shard->PushGradient(&ctx, &resp);
    std::vector<v1::GradientChunk> c = Chunks(1, 2);
    writer->Write(c[0]);
    writer->Write(c[1]);
    ctx.TryCancel();
    return writer->Finish();
  });
  // An oversized stream is refused without holding it all.
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "more than", [&] {
    std::vector<v1::GradientChunk> big;
    v1::GradientChunk c = Chunks(1, 1)[0];
    c.mutable_data()->assign(40 << 20, '\0');
    c.set_crc32c(0);
    big.push_back(c);
    big.push_back(c);
    return client_->Push(big);
  });
  // After all that, ranks 1 and 2 push correctly and the step completes.
  ASSERT_TRUE(client_->Push(Chunks(1, 1)).ok());
  ASSERT_TRUE(client_->Push(Chunks(1, 2)).ok());
  v1::PrepareStepResponse p;
  ASSERT_TRUE(client_->Prepare("job", 1, &p).ok());
  const double expected = 0.25 * 0.25 * (config_.map.total_elements());
  EXPECT_NEAR(p.grad_sq_sum(), expected, expected * 1e-6);
}

TEST_F(BadInputTest, NanGradientsAreReportedNotFatal) {
  grad_[5] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(client_->Push(Chunks(1, 1)).ok());
  ASSERT_TRUE(client_->Push(Chunks(1, 2)).ok());
  v1::PrepareStepResponse p;
  ASSERT_TRUE(client_->Prepare("job", 1, &p).ok());
  EXPECT_TRUE(p.found_inf_nan());
  // The leader skips the step: parameters stay, the step advances.
  std::vector<float> before, after;
  ASSERT_TRUE(client_->Gather("job", 0, {0, 100}, &before).ok());
  v1::CommitStepResponse c;
  ASSERT_TRUE(client_->Commit("job", 1, 0.1f, 1.0f, true, &c).ok());
  EXPECT_TRUE(c.skipped());
  ASSERT_TRUE(client_->Gather("job", 1, {0, 100}, &after).ok());
  EXPECT_EQ(before, after);
}

TEST_F(BadInputTest, GatherPrepareCommitInit) {
  std::vector<float> out;
  const uint64_t total = config_.map.total_elements();
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return client_->Gather("nope", 0, {0, 10}, &out); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "outside",
                 [&] { return client_->Gather("job", 0, {total - 5, total + 5}, &out); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "empty",
                 [&] { return client_->Gather("job", 0, {10, 10}, &out); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "dtype", [&] {
    return client_->Gather("job", 0, {0, 10}, &out, 0, v1::DTYPE_UNSPECIFIED);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "dtype", [&] {
    return client_->Gather("job", 0, {0, 10}, &out, 0, v1::DTYPE_FP16);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "wait_ms",
                 [&] { return client_->Gather("job", 0, {0, 10}, &out, 700000); });
  // A bulk reader's report of its reads: bounded, and only with wait_only.
  auto report = [&](bool wait_only, uint64_t bytes) {
    v1::GatherRequest req;
    req.set_job_id("job");
    req.mutable_range()->set_begin(0);
    req.mutable_range()->set_end(10);
    req.set_dtype(v1::DTYPE_FP32);
    req.set_wait_only(wait_only);
    req.set_unreported_read_bytes(bytes);
    std::vector<v1::ParameterChunk> chunks;
    return client_->Gather(req, &chunks);
  };
  ExpectRejected(grpc::INVALID_ARGUMENT, "unreported_read_bytes: at most 1099511627776",
                 [&] { return report(true, (uint64_t{1} << 40) + 1); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "unreported_read_bytes: only with wait_only",
                 [&] { return report(false, 4096); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "cannot be committed before",
                 [&] { return client_->Gather("job", 5, {0, 10}, &out); });
  ExpectRejected(grpc::DEADLINE_EXCEEDED, "not committed in time",
                 [&] { return client_->Gather("job", 1, {0, 10}, &out, 50); });
  v1::StepState state;
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return client_->StepState("nope", &state, 1, 10); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "wait_ms",
                 [&] { return client_->StepState("job", &state, 1, 700000); });

  v1::PrepareStepResponse p;
  ExpectRejected(grpc::NOT_FOUND, "not registered", [&] { return client_->Prepare("nope", 1, &p); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "computing step 1",
                 [&] { return client_->Prepare("job", 2, &p); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "waits for rank 1",
                 [&] { return client_->Prepare("job", 1, &p); });
  // Only the leader, at its current incarnation, prepares.
  auto prepare_as = [&](uint32_t rank, uint64_t incarnation) {
    return [&, rank, incarnation] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::PrepareStepRequest req;
      req.set_job_id("job");
      req.set_step(1);
      req.set_rank(rank);
      req.set_incarnation(incarnation);
      return client_->shard->PrepareStep(&ctx, req, &p);
    };
  };
  ExpectRejected(grpc::INVALID_ARGUMENT, "only the job leader (rank 0) prepares",
                 prepare_as(1, testing::kTestIncarnation));
  ExpectRejected(grpc::INVALID_ARGUMENT, "incarnation: must be >= 1", prepare_as(0, 0));
  ExpectRejected(grpc::FAILED_PRECONDITION, "incarnation",
                 prepare_as(0, testing::kTestIncarnation + 1));

  ExpectRejected(grpc::FAILED_PRECONDITION, "computing step 1",
                 [&] { return client_->Commit("job", 3, 0.1f); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "lr", [&] { return client_->Commit("job", 1, -0.1f); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "lr",
                 [&] { return client_->Commit("job", 1, std::numeric_limits<float>::infinity()); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "clip_coef",
                 [&] { return client_->Commit("job", 1, 0.1f, 2.0f); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "clip_coef",
                 [&] { return client_->Commit("job", 1, 0.1f, -1.0f); });
  // Bug 4: a commit, skipping or not, needs a PrepareStep (and so complete
  // gradients) first.
  ExpectRejected(grpc::FAILED_PRECONDITION, "CommitStep before PrepareStep",
                 [&] { return client_->Commit("job", 1, 0.1f); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "CommitStep before PrepareStep",
                 [&] { return client_->Commit("job", 1, 0.1f, 1.0f, /*skip=*/true); });

  auto init = [&](auto mutate) {
    return [this, mutate] {
      v1::ParameterChunk c;
      c.set_job_id("job");
      c.mutable_range()->set_begin(0);
      c.mutable_range()->set_end(4);
      c.set_dtype(v1::DTYPE_FP32);
      c.set_data(std::string(16, '\0'));
      mutate(c);
      return client_->Init({c});
    };
  };
  ExpectRejected(grpc::INVALID_ARGUMENT, "bytes, expected",
                 init([](v1::ParameterChunk& c) { c.set_data("abc"); }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "outside", init([&](v1::ParameterChunk& c) {
                   c.mutable_range()->set_begin(total);
                   c.mutable_range()->set_end(total + 4);
                 }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "dtype",
                 init([](v1::ParameterChunk& c) { c.set_dtype(static_cast<v1::DType>(42)); }));
  ExpectRejected(grpc::DATA_LOSS, "CRC-32C",
                 init([](v1::ParameterChunk& c) { c.set_crc32c(12345); }));
  // After the first commit, initial parameters are refused.
  ASSERT_TRUE(client_->Push(Chunks(1, 1)).ok());
  ASSERT_TRUE(client_->Push(Chunks(1, 2)).ok());
  ASSERT_TRUE(client_->Prepare("job", 1, &p).ok());
  // Once prepared, a replay of a held contribution (a restarted rank) is a
  // duplicate; other bytes are refused: the gradient is frozen.
  ExpectRejected(grpc::ALREADY_EXISTS, "same CRC-32C", [&] { return client_->Push(Chunks(1, 1)); });
  grad_.assign(grad_.size(), 0.5f);
  ExpectRejected(grpc::FAILED_PRECONDITION, "is prepared",
                 [&] { return client_->Push(Chunks(1, 1)); });
  // A long poll for the step answers once the commit lands, and one that
  // times out answers the state as it is.
  ASSERT_TRUE(client_->StepState("job", &state, 1, 20).ok());
  EXPECT_EQ(state.committed_step(), 0u);
  std::thread commit([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(client_->Commit("job", 1, 0.1f).ok());
  });
  ASSERT_TRUE(client_->StepState("job", &state, 1, 60000).ok());
  EXPECT_EQ(state.committed_step(), 1u);
  commit.join();
  // Steps already committed, or past the open one, are answered at once.
  ASSERT_TRUE(client_->StepState("job", &state, 1, 60000).ok());
  EXPECT_EQ(state.committed_step(), 1u);
  ASSERT_TRUE(client_->StepState("job", &state, 5, 60000).ok());
  EXPECT_EQ(state.committed_step(), 1u);
  ExpectRejected(grpc::FAILED_PRECONDITION, "before the first commit",
                 init([](v1::ParameterChunk&) {}));
  // Committing the committed step again is idempotent.
  const uint64_t before = Hash();
  ASSERT_TRUE(client_->Commit("job", 1, 0.1f).ok());
  EXPECT_EQ(Hash(), before);
}

// no_grad_tensors: layout indices, ascending, each overlapping the chunk.
TEST_F(BadInputTest, PushGradientNoGradTensors) {
  // A chunk of rank 1 that overlaps several tensors.
  std::vector<v1::GradientChunk> chunks = Chunks(1, 1);
  size_t k = 0;
  std::pair<size_t, size_t> in;
  for (; k < chunks.size(); ++k) {
    in = config_.layout.TensorsIn({chunks[k].range().begin(), chunks[k].range().end()});
    if (in.second - in.first >= 2) break;
  }
  ASSERT_LT(k, chunks.size());
  const uint32_t first = static_cast<uint32_t>(in.first);
  const uint32_t last = static_cast<uint32_t>(in.second);  // one past
  auto marked = [&](std::vector<uint32_t> tensors) {
    std::vector<v1::GradientChunk> c = chunks;
    c[k].mutable_no_grad_tensors()->Add(tensors.begin(), tensors.end());
    return [this, c] { return client_->Push(c); };
  };
  const std::string field = absl::StrCat("chunk ", k, ".no_grad_tensors[");
  ExpectRejected(grpc::INVALID_ARGUMENT, field + "1]", marked({first + 1, first}));
  ExpectRejected(grpc::INVALID_ARGUMENT, field + "1]", marked({first, first}));
  ExpectRejected(grpc::INVALID_ARGUMENT, field + "0]", marked({last}));
  ExpectRejected(grpc::INVALID_ARGUMENT, field + "1]", marked({first, last}));
  ExpectRejected(grpc::INVALID_ARGUMENT, field + "0]", marked({1000}));
  if (first > 0) ExpectRejected(grpc::INVALID_ARGUMENT, field + "0]", marked({first - 1}));
  // Every tensor the chunk overlaps, ascending, is fine.
  std::vector<uint32_t> all;
  for (uint32_t t = first; t < last; ++t) all.push_back(t);
  EXPECT_TRUE(marked(all)().ok());
}

TEST_F(BadInputTest, CommitStepGroupLrs) {
  // "job" has one group; the lrs are checked before anything else.
  ExpectRejected(grpc::INVALID_ARGUMENT, "group_lrs: job job has 1 parameter groups, got 2",
                 [&] { return CommitGroups("job", 1, {0.1f, 0.2f}); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "group_lrs[0]: must be finite and >= 0",
                 [&] { return CommitGroups("job", 1, {-0.1f}); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "group_lrs[0]",
                 [&] { return CommitGroups("job", 1, {std::nanf("")}); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "group_lrs[0]", [&] {
    return CommitGroups("job", 1, {std::numeric_limits<float>::infinity()});
  });
  // "sem" has two; refused even when prepared, and nothing moves.
  RegisterSemantics();
  PrepareSemantics(1);
  auto rejected = [&](const std::string& text, std::vector<float> lrs) {
    testing::ExpectRejected(*daemon_, "sem", grpc::INVALID_ARGUMENT, text,
                            [&] { return CommitGroups("sem", 1, lrs); });
  };
  rejected("group_lrs: job sem has 2 parameter groups, got 1", {0.1f});
  rejected("group_lrs: job sem has 2 parameter groups, got 3", {0.1f, 0.1f, 0.1f});
  rejected("group_lrs[1]", {0.1f, std::nanf("")});
  rejected("group_lrs[1]", {0.1f, -1.0f});
  grpc::Status ok = CommitGroups("sem", 1, {0.1f, 0.0f});
  ASSERT_TRUE(ok.ok()) << ok.error_message();
}

TEST_F(BadInputTest, ReadState) {
  RegisterSemantics();
  auto read = [&](auto mutate) {
    return [this, mutate] {
      v1::ReadStateRequest req;
      req.set_job_id("sem");
      req.set_rank(1);
      req.set_incarnation(testing::kTestIncarnation);
      req.set_array(v1::STATE_ARRAY_EXP_AVG);
      req.mutable_range()->set_begin(0);
      req.mutable_range()->set_end(kSemOwned);
      mutate(req);
      std::vector<v1::StateChunk> chunks;
      return client_->ReadState(req, &chunks);
    };
  };
  auto rejected = [&](grpc::StatusCode code, const std::string& text, auto call) {
    testing::ExpectRejected(*daemon_, "sem", code, text, call);
  };
  ASSERT_TRUE(read([](v1::ReadStateRequest&) {})().ok());
  rejected(grpc::NOT_FOUND, "not registered",
           read([](v1::ReadStateRequest& r) { r.set_job_id("nope"); }));
  rejected(grpc::INVALID_ARGUMENT, "array: must be MASTER (1), EXP_AVG (2) or EXP_AVG_SQ (3)",
           read([](v1::ReadStateRequest& r) { r.set_array(v1::STATE_ARRAY_UNSPECIFIED); }));
  rejected(grpc::INVALID_ARGUMENT, "array: must be",
           read([](v1::ReadStateRequest& r) { r.set_array(static_cast<v1::StateArray>(9)); }));
  // Outside the partitions this daemon owns (the other daemon's, or past the
  // end), or empty.
  for (const FlatRange bad : {FlatRange{100, 140}, FlatRange{128, 240}, FlatRange{200, 300},
                              FlatRange{5, 5}, FlatRange{9, 3}}) {
    rejected(grpc::INVALID_ARGUMENT, "is empty or outside the parameters this daemon owns [0, 128)",
             read([bad](v1::ReadStateRequest& r) {
               r.mutable_range()->set_begin(bad.begin);
               r.mutable_range()->set_end(bad.end);
             }));
  }
  // A rank the job does not have, or an incarnation that did not join.
  rejected(grpc::INVALID_ARGUMENT, "rank",
           read([](v1::ReadStateRequest& r) { r.set_rank(2); }));
  rejected(grpc::FAILED_PRECONDITION, "has not joined as incarnation 5",
           read([](v1::ReadStateRequest& r) { r.set_incarnation(5); }));
  rejected(grpc::INVALID_ARGUMENT, "incarnation",
           read([](v1::ReadStateRequest& r) { r.set_incarnation(0); }));
  // While a step is prepared: its commit would change what is read.
  PrepareSemantics(1);
  rejected(grpc::FAILED_PRECONDITION, "step 1 is prepared", read([](v1::ReadStateRequest&) {}));
  ASSERT_TRUE(CommitGroups("sem", 1, {0.1f, 0.2f}).ok());
  ASSERT_TRUE(read([](v1::ReadStateRequest&) {})().ok());
}

TEST_F(BadInputTest, WriteState) {
  RegisterSemantics();
  const std::vector<float> masters = Masked(2.0f, false);
  const std::vector<float> moments = Masked(0.25f, true);
  auto write = [&](std::vector<v1::StateChunk> chunks) {
    return [this, chunks] { return client_->WriteState(chunks); };
  };
  auto rejected = [&](grpc::StatusCode code, const std::string& text, auto call) {
    testing::ExpectRejected(*daemon_, "sem", code, text, call);
  };
  const v1::StateChunk good = SemChunk(v1::STATE_ARRAY_MASTER, {0, 64}, masters.data());
  auto one = [&](auto mutate) {
    v1::StateChunk c = good;
    mutate(c);
    return write({c});
  };
  rejected(grpc::NOT_FOUND, "not registered", one([](v1::StateChunk& c) { c.set_job_id("nope"); }));
  rejected(grpc::INVALID_ARGUMENT, "no chunk", write({}));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.array: must be",
           one([](v1::StateChunk& c) { c.set_array(v1::STATE_ARRAY_UNSPECIFIED); }));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.array: must be",
           one([](v1::StateChunk& c) { c.set_array(static_cast<v1::StateArray>(4)); }));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.rank",
           one([](v1::StateChunk& c) { c.set_rank(2); }));
  rejected(grpc::FAILED_PRECONDITION, "has not joined as incarnation 9",
           one([](v1::StateChunk& c) { c.set_incarnation(9); }));
  // A range outside this daemon's part, reversed, or data of another size.
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.range [120, 136) is outside the parameters",
           write({SemChunk(v1::STATE_ARRAY_MASTER, {120, 136}, std::vector<float>(16).data())}));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.range [200, 210) is outside",
           write({SemChunk(v1::STATE_ARRAY_MASTER, {200, 210}, std::vector<float>(10).data())}));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.range [70, 2) is outside",
           one([](v1::StateChunk& c) {
             c.mutable_range()->set_begin(70);
             c.mutable_range()->set_end(2);
           }));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.data: 256 bytes, expected 252",
           one([](v1::StateChunk& c) { c.mutable_range()->set_end(63); }));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.data: 0 bytes, expected 256",
           one([](v1::StateChunk& c) {
             c.clear_data();
             c.set_crc32c(0);
           }));
  rejected(grpc::DATA_LOSS, "CRC-32C",
           one([](v1::StateChunk& c) { (*c.mutable_data())[5] ^= 0x10; }));
  // Zeros where there is no state: the gaps, and the frozen tensor's moments.
  std::vector<float> gap = masters;
  gap[75] = 1.0f;
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.data: element 75 is an alignment gap",
           write({SemChunk(v1::STATE_ARRAY_MASTER, {64, 128}, gap.data() + 64)}));
  std::vector<float> in_frozen = moments;
  in_frozen[85] = 1e-3f;
  rejected(grpc::INVALID_ARGUMENT, "chunk 1.data: element 85 is in frozen tensor 1",
           write({SemChunk(v1::STATE_ARRAY_EXP_AVG, {0, 64}, moments.data()),
                  SemChunk(v1::STATE_ARRAY_EXP_AVG_SQ, {64, 128}, in_frozen.data() + 64)}));
  // Two chunks of one array over the same elements.
  rejected(grpc::INVALID_ARGUMENT, "chunk 1.range [60, 70) overlaps chunk 0",
           write({good, SemChunk(v1::STATE_ARRAY_MASTER, {60, 70}, masters.data() + 60)}));
  // Update counts: trainable tensors overlapping this daemon's range, each
  // once a stream.
  auto counts = [&](std::vector<std::pair<uint32_t, uint64_t>> steps) {
    v1::StateChunk c = SemChunk(v1::STATE_ARRAY_MASTER, {0, 0}, nullptr);
    for (const auto& [t, n] : steps) {
      v1::TensorStep* s = c.add_tensor_steps();
      s->set_tensor(t);
      s->set_steps(n);
    }
    return c;
  };
  rejected(grpc::INVALID_ARGUMENT, "chunk 1.tensor_steps[0]: tensor 1 is frozen",
           write({good, counts({{1, 4}})}));
  rejected(grpc::INVALID_ARGUMENT, "chunk 0.tensor_steps[1]: tensor 3 does not overlap",
           write({counts({{0, 4}, {3, 4}})}));
  rejected(grpc::INVALID_ARGUMENT, "tensor 17 does not overlap", write({counts({{17, 1}})}));
  rejected(grpc::INVALID_ARGUMENT, "tensor_steps: tensor 0 is set twice",
           write({counts({{0, 4}}), good, counts({{2, 1}, {0, 5}})}));
  rejected(grpc::INVALID_ARGUMENT, "tensor_steps: tensor 2 is set twice",
           write({counts({{2, 4}, {2, 4}})}));
  // A stream whose last chunk is bad applies none of the good ones before it.
  rejected(grpc::INVALID_ARGUMENT, "chunk 2.data: element 75",
           write({counts({{0, 9}}), good,
                  SemChunk(v1::STATE_ARRAY_MASTER, {64, 128}, gap.data() + 64)}));
  // Not while a step is prepared; the prepared step stays.
  PrepareSemantics(1);
  rejected(grpc::FAILED_PRECONDITION, "step 1 is prepared", write({good}));
  rejected(grpc::FAILED_PRECONDITION, "step 1 is prepared", write({counts({{0, 4}})}));
  ASSERT_TRUE(CommitGroups("sem", 1, {0.1f, 0.2f}).ok());
  EXPECT_TRUE(write({good, counts({{0, 4}})})().ok());
}

// What WriteState writes is what ReadState reads and a gather gathers, and
// the next step updates from there, each tensor with its own count.
TEST_F(BadInputTest, StateWrittenIsReadGatheredAndSteppedFrom) {
  RegisterSemantics();
  const FlatRange owned{0, kSemOwned};
  const std::vector<float> masters = Masked(2.0f, false);
  const std::vector<float> m = Masked(0.25f, true);
  const std::vector<float> v = Masked(0.5f, true);
  v1::StateChunk counts = SemChunk(v1::STATE_ARRAY_MASTER, {0, 0}, nullptr);
  v1::TensorStep* t = counts.add_tensor_steps();
  t->set_tensor(0);
  t->set_steps(7);
  t = counts.add_tensor_steps();
  t->set_tensor(2);
  t->set_steps(3);
  v1::WriteStateResponse resp;
  grpc::Status s = client_->WriteState(
      {SemChunk(v1::STATE_ARRAY_MASTER, {0, 64}, masters.data()),
       SemChunk(v1::STATE_ARRAY_MASTER, {64, 128}, masters.data() + 64),
       SemChunk(v1::STATE_ARRAY_EXP_AVG, owned, m.data()),
       SemChunk(v1::STATE_ARRAY_EXP_AVG_SQ, {32, 128}, v.data() + 32), counts},
      &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.elements(), 128u + 128u + 96u);
  EXPECT_EQ(resp.tensor_steps(), 2u);
  std::vector<float> out;
  std::vector<v1::TensorStep> steps;
  auto step_map = [&] {
    std::map<uint32_t, uint64_t> r;
    for (const v1::TensorStep& x : steps) r[x.tensor()] = x.steps();
    return r;
  };
  ASSERT_TRUE(client_->ReadState("sem", 1, v1::STATE_ARRAY_MASTER, owned, &out, &steps).ok());
  EXPECT_EQ(out, masters);
  EXPECT_EQ(step_map(), (std::map<uint32_t, uint64_t>{{0, 7}, {2, 3}}));
  ASSERT_TRUE(client_->ReadState("sem", 0, v1::STATE_ARRAY_EXP_AVG, owned, &out, nullptr).ok());
  EXPECT_EQ(out, m);
  ASSERT_TRUE(client_->ReadState("sem", 0, v1::STATE_ARRAY_EXP_AVG_SQ, owned, &out, nullptr).ok());
  std::vector<float> v_expected = v;
  std::fill(v_expected.begin(), v_expected.begin() + 32, 0.0f);  // never written
  EXPECT_EQ(out, v_expected);
  // A sub-range: the counts of the trainable tensors it overlaps only.
  ASSERT_TRUE(client_->ReadState("sem", 0, v1::STATE_ARRAY_MASTER, {75, 90}, &out, &steps).ok());
  EXPECT_EQ(out, std::vector<float>(masters.begin() + 75, masters.begin() + 90));
  EXPECT_TRUE(steps.empty());  // a gap and the frozen tensor
  std::vector<float> gathered;
  ASSERT_TRUE(client_->Gather("sem", 0, owned, &gathered).ok());
  EXPECT_EQ(gathered, masters);
  // A step where w1 has no gradient: w0 is updated (count 8), w1 keeps its
  // values and its count, the frozen tensor its values.
  PrepareSemantics(1, /*w1_no_grad=*/true);
  ASSERT_TRUE(CommitGroups("sem", 1, {0.1f, 0.2f}).ok());
  ASSERT_TRUE(client_->ReadState("sem", 0, v1::STATE_ARRAY_MASTER, owned, &out, &steps).ok());
  EXPECT_EQ(step_map(), (std::map<uint32_t, uint64_t>{{0, 8}, {2, 3}}));
  for (uint64_t i = 0; i < 70; ++i) EXPECT_NE(out[i], masters[i]) << i;
  for (uint64_t i = 70; i < kSemOwned; ++i) EXPECT_EQ(out[i], masters[i]) << i;
  ASSERT_TRUE(client_->ReadState("sem", 0, v1::STATE_ARRAY_EXP_AVG, owned, &out, nullptr).ok());
  for (uint64_t i = 112; i < kSemOwned; ++i) EXPECT_EQ(out[i], m[i]) << i;
  // Counts alone (an empty range) are a write too.
  s = client_->WriteState({counts}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.elements(), 0u);
  ASSERT_TRUE(client_->ReadState("sem", 0, v1::STATE_ARRAY_MASTER, {0, 8}, &out, &steps).ok());
  EXPECT_EQ(step_map(), (std::map<uint32_t, uint64_t>{{0, 7}}));
}

TEST_F(BadInputTest, Admin) {
  ExpectRejected(grpc::NOT_FOUND, "not registered", [&] {
    grpc::ClientContext ctx;
    v1::MemoryReportRequest req;
    req.set_job_id("nope");
    v1::MemoryReportResponse resp;
    return client_->admin->MemoryReport(&ctx, req, &resp);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "params", [&] {
    grpc::ClientContext ctx;
    v1::EstimateRequest req;
    req.set_parameters(-1);
    req.set_world_size(4);
    v1::EstimateResponse resp;
    return client_->admin->Estimate(&ctx, req, &resp);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "world_size", [&] {
    grpc::ClientContext ctx;
    v1::EstimateRequest req;
    req.set_parameters(1e9);
    v1::EstimateResponse resp;
    return client_->admin->Estimate(&ctx, req, &resp);
  });
  grpc::ClientContext ctx;
  v1::EstimateRequest req;
  req.set_parameters(7.5e9);
  req.set_world_size(64);
  v1::EstimateResponse resp;
  ASSERT_TRUE(client_->admin->Estimate(&ctx, req, &resp).ok());
  EXPECT_NEAR(resp.stages(1).model_state_bytes(), 31.40625e9, 1);
  // No daemon count: one daemon per rank, 7.5e9/64 owned elements each.
  EXPECT_EQ(resp.daemon().daemons(), 64u);
  EXPECT_EQ(resp.daemon().ram_bytes(), 18 * 7.5e9 / 64);
  EXPECT_EQ(resp.daemon().state_dir_ram_bytes(), 6 * 7.5e9 / 64 + 12 * 1024 * 1024);
  EXPECT_EQ(resp.daemon().state_dir_disk_bytes(), 12 * 7.5e9 / 64);
  // 3e9 parameters on 2 daemons, whatever the ranks: 1.5e9 elements each.
  grpc::ClientContext ctx2;
  req.set_parameters(3e9);
  req.set_daemons(2);
  ASSERT_TRUE(client_->admin->Estimate(&ctx2, req, &resp).ok());
  EXPECT_EQ(resp.daemon().daemons(), 2u);
  EXPECT_EQ(resp.daemon().ram_bytes(), 27e9);
  EXPECT_EQ(resp.daemon().state_dir_ram_bytes(), 9e9 + 12582912);
  EXPECT_EQ(resp.daemon().state_dir_disk_bytes(), 18e9);
  // A daemon without --state_dir keeps every job in RAM: nothing on disk.
  grpc::ClientContext ctx3;
  v1::StatusResponse status;
  ASSERT_TRUE(client_->admin->Status(&ctx3, v1::StatusRequest(), &status).ok());
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).state_disk_bytes(), 0u);
}

}  // namespace
}  // namespace zeroshard
