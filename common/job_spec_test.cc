#include "common/job_spec.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

Layout TwoTensors() {
  return *Layout::Create({{"w", {3, 5}, DType::kFp32, 0}, {"b", {7}, DType::kFp32, 1}}, 0);
}

JobSettings Valid() {
  JobSettings s;
  s.job_id = "run-1";
  s.stage = 3;
  s.world_size = 4;
  s.daemons = {"10.0.0.1:7070", "node-b:7070"};
  return s;
}

TEST(JobSpecTest, RoundTripThroughTheWire) {
  JobSettings s = Valid();
  s.optimizer.kind = OptimizerKind::kSgdMomentum;
  s.optimizer.momentum = 0.5f;
  s.loss_scale.dynamic = true;
  s.loss_scale.initial_scale = 1024;
  s.precision = DType::kFp16;
  const v1::JobSpec spec = ToJobSpec(s, TwoTensors());
  absl::StatusOr<JobConfig> c = ParseJobSpec(spec);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->job_id, "run-1");
  EXPECT_EQ(c->stage, 3u);
  EXPECT_EQ(c->world_size, 4u);
  EXPECT_EQ(c->precision, DType::kFp16);
  EXPECT_EQ(c->optimizer.kind, OptimizerKind::kSgdMomentum);
  EXPECT_EQ(c->optimizer.momentum, 0.5f);
  EXPECT_TRUE(c->loss_scale.dynamic);
  EXPECT_EQ(c->loss_scale.initial_scale, 1024.0f);
  EXPECT_EQ(c->daemons, s.daemons);
  EXPECT_EQ(c->layout.fingerprint(), TwoTensors().fingerprint());
  EXPECT_EQ(c->map.world_size(), 4u);
  EXPECT_EQ(DescribeSpecDifference(spec, ToJobSpec(*c, c->layout)), "");
}

// Ranks that built different models: the difference names the tensor.
TEST(JobSpecTest, LayoutDifferenceNamesTheTensor) {
  const v1::JobSpec registered = ToJobSpec(Valid(), TwoTensors());
  struct Case {
    std::vector<TensorSpec> tensors;
    const char* expected;
  };
  const Case cases[] = {
      {{{"w", {3, 5}, DType::kFp32, 0}, {"b", {8}, DType::kFp32, 1}},
       "layout.tensors[1] 'b': registered shape [7], got shape [8]"},
      {{{"w", {3, 5}, DType::kFp32, 0}, {"bias", {7}, DType::kFp32, 1}},
       "layout.tensors[1]: registered 'b', got 'bias'"},
      {{{"w", {3, 5}, DType::kFp32, 0}, {"b", {7}, DType::kFp32, 0}},
       "layout.tensors[1] 'b': registered in layer 1, got layer 0"},
      {{{"w", {3, 5}, DType::kFp32, 0}, {"b", {7}, DType::kBf16, 1}},
       "layout.tensors[1] 'b': registered dtype DTYPE_FP32, got DTYPE_BF16"},
      {{{"w", {3, 5}, DType::kFp32, 0}},
       "layout: registered 2 tensors, got 1 (the first not in both: 'b')"},
      {{{"w", {3, 5}, DType::kFp32, 0}, {"b", {7}, DType::kFp32, 1}, {"c", {1}, DType::kFp32, 1}},
       "layout: registered 2 tensors, got 3 (the first not in both: 'c')"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Layout> layout = Layout::Create(c.tensors, 0);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(DescribeSpecDifference(registered, ToJobSpec(Valid(), *layout)), c.expected);
  }
  v1::JobSpec realigned = ToJobSpec(
      Valid(), *Layout::Create({{"w", {3, 5}, DType::kFp32, 0}, {"b", {7}, DType::kFp32, 1}}, 128));
  EXPECT_EQ(DescribeSpecDifference(registered, realigned),
            "layout.alignment_elements: registered 64, got 128");
}

TEST(JobSpecTest, OneHostPortRuleForBothSides) {
  for (const char* good : {"a:1", "node0:7070", "[::1]:7070", "10.1.2.3:65535"}) {
    EXPECT_TRUE(ValidateHostPort(good, "f").ok()) << good;
  }
  for (const char* bad : {"", ":7070", "node0:", "node0", "node0:70x0", "::1:7070",
                          "node0:123456"}) {
    absl::Status s = ValidateHostPort(bad, "daemons[0]");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("daemons[0]: must be HOST:PORT"), std::string::npos) << s;
  }
}

TEST(JobSpecTest, ClientAndDaemonRefuseTheSameSettingsNamingTheField) {
  struct Case {
    const char* field;
    void (*mutate)(JobSettings&);
  };
  const Case cases[] = {
      {"job_id", [](JobSettings& s) { s.job_id = "bad id"; }},
      {"stage", [](JobSettings& s) { s.stage = 0; }},
      {"world_size", [](JobSettings& s) { s.world_size = 0; }},
      {"optimizer.beta1", [](JobSettings& s) { s.optimizer.beta1 = 1.5f; }},
      {"optimizer.eps", [](JobSettings& s) { s.optimizer.eps = 0; }},
      {"optimizer.weight_decay", [](JobSettings& s) { s.optimizer.weight_decay = -1; }},
      {"loss_scale.initial_scale", [](JobSettings& s) { s.loss_scale.initial_scale = -2; }},
      {"bucket_bytes", [](JobSettings& s) { s.bucket_bytes = 100; }},
      {"daemons", [](JobSettings& s) { s.daemons.clear(); }},
      {"daemons[1]", [](JobSettings& s) { s.daemons[1] = "nodeb"; }},
      {"daemons[1]", [](JobSettings& s) { s.daemons[1] = s.daemons[0]; }},
  };
  for (const Case& c : cases) {
    JobSettings s = Valid();
    c.mutate(s);
    absl::Status client = ValidateJobSettings(s, "ClientConfig.");
    EXPECT_EQ(client.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(client.message().find(absl::StrCat("ClientConfig.", c.field, ":")),
              std::string::npos)
        << client;
    // The daemon parses the wire form with the same rule.
    absl::StatusOr<JobConfig> daemon = ParseJobSpec(ToJobSpec(s, TwoTensors()));
    EXPECT_EQ(daemon.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(daemon.status().message().find(absl::StrCat("spec.", c.field, ":")),
              std::string::npos)
        << daemon.status();
  }
}

TEST(JobSpecTest, FingerprintMismatchIsRefused) {
  v1::JobSpec spec = ToJobSpec(Valid(), TwoTensors());
  spec.set_layout_fingerprint(spec.layout_fingerprint() + 1);
  absl::StatusOr<JobConfig> c = ParseJobSpec(spec);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("spec.layout_fingerprint"), std::string::npos);
}

TEST(ProtocolTest, TransportKindNames) {
  for (const char* name : {"ucx", "grpc", "inproc"}) {
    absl::StatusOr<v1::TransportKind> k = TransportKindFromName(name, "t");
    ASSERT_TRUE(k.ok());
    EXPECT_EQ(TransportKindName(*k), name);
  }
  EXPECT_EQ(TransportKindFromName("stream", "--bulk_transport").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
