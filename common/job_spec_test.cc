#include "common/job_spec.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
      {"node_cache", [](JobSettings& s) {
         s.node_cache = true;
         s.replicas = 2;
       }},
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

TEST(JobSpecTest, NodeCacheRoundTripsAndRanksMustAgreeOnIt) {
  JobSettings s = Valid();
  s.node_cache = true;
  const v1::JobSpec spec = ToJobSpec(s, TwoTensors());
  EXPECT_TRUE(spec.node_cache());
  absl::StatusOr<JobConfig> c = ParseJobSpec(spec);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->node_cache);
  EXPECT_EQ(DescribeSpecDifference(spec, ToJobSpec(*c, c->layout)), "");
  EXPECT_EQ(DescribeSpecDifference(spec, ToJobSpec(Valid(), TwoTensors())),
            "node_cache: registered true, got false");
}

TEST(JobSpecTest, FingerprintMismatchIsRefused) {
  v1::JobSpec spec = ToJobSpec(Valid(), TwoTensors());
  spec.set_layout_fingerprint(spec.layout_fingerprint() + 1);
  absl::StatusOr<JobConfig> c = ParseJobSpec(spec);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("spec.layout_fingerprint"), std::string::npos);
}

// Two groups: "w" in group 0, "b" (alias "b_tied") in group 1, "buf"
// frozen; then `mutate`.
Layout GroupedTensors(void (*mutate)(std::vector<TensorSpec>&) = nullptr) {
  std::vector<TensorSpec> specs = {{"w", {3, 5}, DType::kFp32, 0},
                                   {"b", {7}, DType::kFp32, 1},
                                   {"buf", {4}, DType::kFp32, 1}};
  specs[1].group = 1;
  specs[1].aliases = {"b_tied"};
  specs[2].frozen = true;
  if (mutate != nullptr) mutate(specs);
  return *Layout::Create(specs, 0);
}

JobSettings TwoGroups() {
  JobSettings s = Valid();
  s.param_groups = {{0.5f, 0.8f, 0.99f, 1e-6f, 0.1f}, {0.25f, 0.7f, 0.95f, 1e-7f, 0.0f}};
  return s;
}

TEST(JobSpecTest, ParamGroupsRoundTripThroughTheWire) {
  const JobSettings s = TwoGroups();
  const v1::JobSpec spec = ToJobSpec(s, GroupedTensors());
  ASSERT_EQ(spec.param_groups_size(), 2);
  absl::StatusOr<JobConfig> c = ParseJobSpec(spec);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->param_groups.size(), 2u);
  for (size_t g = 0; g < 2; ++g) {
    SCOPED_TRACE(g);
    EXPECT_EQ(c->param_groups[g].lr, s.param_groups[g].lr);
    EXPECT_EQ(c->param_groups[g].beta1, s.param_groups[g].beta1);
    EXPECT_EQ(c->param_groups[g].beta2, s.param_groups[g].beta2);
    EXPECT_EQ(c->param_groups[g].eps, s.param_groups[g].eps);
    EXPECT_EQ(c->param_groups[g].weight_decay, s.param_groups[g].weight_decay);
  }
  EXPECT_EQ(GroupCount(*c), 2u);
  // A group's optimizer is the job's update rule with the group's numbers.
  const OptimizerSettings g1 = GroupOptimizer(*c, 1);
  EXPECT_EQ(g1.kind, s.optimizer.kind);
  EXPECT_EQ(g1.lr, 0.25f);
  EXPECT_EQ(g1.beta1, 0.7f);
  EXPECT_EQ(g1.beta2, 0.95f);
  EXPECT_EQ(g1.eps, 1e-7f);
  EXPECT_EQ(g1.weight_decay, 0.0f);
  // The layout's new fields travel too.
  EXPECT_EQ(c->layout.fingerprint(), GroupedTensors().fingerprint());
  EXPECT_EQ(c->layout.tensors()[1].spec.group, 1u);
  EXPECT_EQ(c->layout.tensors()[1].spec.aliases, std::vector<std::string>{"b_tied"});
  EXPECT_TRUE(c->layout.tensors()[2].spec.frozen);
  EXPECT_EQ(DescribeSpecDifference(spec, ToJobSpec(*c, c->layout)), "");
  // Without groups: one group with the job's optimizer numbers.
  absl::StatusOr<JobConfig> plain = ParseJobSpec(ToJobSpec(Valid(), TwoTensors()));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->param_groups.empty());
  EXPECT_EQ(GroupCount(*plain), 1u);
  EXPECT_EQ(GroupOptimizer(*plain, 0).lr, Valid().optimizer.lr);
}

TEST(JobSpecTest, BadParamGroupsAreRefusedNamingTheGroupAndField) {
  struct Case {
    const char* field;
    void (*mutate)(ParamGroupSettings&);
  };
  const Case cases[] = {
      {"param_groups[1].lr", [](ParamGroupSettings& g) { g.lr = -0.1f; }},
      {"param_groups[1].lr", [](ParamGroupSettings& g) { g.lr = std::nanf(""); }},
      {"param_groups[1].lr",
       [](ParamGroupSettings& g) { g.lr = std::numeric_limits<float>::infinity(); }},
      {"param_groups[1].beta1", [](ParamGroupSettings& g) { g.beta1 = 1.0f; }},
      {"param_groups[1].beta1", [](ParamGroupSettings& g) { g.beta1 = -0.5f; }},
      {"param_groups[1].beta2", [](ParamGroupSettings& g) { g.beta2 = 1.5f; }},
      {"param_groups[1].eps", [](ParamGroupSettings& g) { g.eps = 0.0f; }},
      {"param_groups[1].eps",
       [](ParamGroupSettings& g) { g.eps = std::numeric_limits<float>::infinity(); }},
      {"param_groups[1].weight_decay", [](ParamGroupSettings& g) { g.weight_decay = -1e-3f; }},
      {"param_groups[1].weight_decay",
       [](ParamGroupSettings& g) { g.weight_decay = std::nanf(""); }},
  };
  for (const Case& c : cases) {
    JobSettings s = TwoGroups();
    c.mutate(s.param_groups[1]);
    absl::Status client = ValidateJobSettings(s, "ClientConfig.");
    EXPECT_EQ(client.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(client.message().find(absl::StrCat("ClientConfig.", c.field, ":")),
              std::string::npos)
        << client;
    absl::StatusOr<JobConfig> daemon = ParseJobSpec(ToJobSpec(s, GroupedTensors()));
    EXPECT_EQ(daemon.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(daemon.status().message().find(absl::StrCat("spec.", c.field, ":")),
              std::string::npos)
        << daemon.status();
  }
  // SGD has no betas or eps: a group's are not checked.
  JobSettings sgd = TwoGroups();
  sgd.optimizer.kind = OptimizerKind::kSgdMomentum;
  sgd.param_groups[1].beta1 = 7.0f;
  sgd.param_groups[1].eps = 0.0f;
  EXPECT_TRUE(ValidateJobSettings(sgd, "").ok());
  // Too many groups.
  JobSettings many = Valid();
  many.param_groups.resize(Layout::kMaxParamGroups + 1);
  EXPECT_NE(ValidateJobSettings(many, "x.").message().find("x.param_groups:"), std::string::npos);
  v1::JobSpec spec = ToJobSpec(many, TwoTensors());
  absl::StatusOr<JobConfig> parsed = ParseJobSpec(spec);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("spec.param_groups"), std::string::npos)
      << parsed.status();
}

TEST(JobSpecTest, ATensorInAGroupTheJobLacksIsRefusedNamingTheTensor) {
  // "b" is in group 1; a job without groups has group 0 only.
  absl::StatusOr<JobConfig> c = ParseJobSpec(ToJobSpec(Valid(), GroupedTensors()));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("spec.layout.tensors[1].group (b)"), std::string::npos)
      << c.status();
  absl::Status s = ValidateLayoutGroups(Valid(), GroupedTensors(), "RegisterModel: ");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("RegisterModel: layout.tensors[1].group (b)"), std::string::npos) << s;
  // One group is not enough either; two are.
  JobSettings one = Valid();
  one.param_groups = {ParamGroupSettings{}};
  EXPECT_EQ(ValidateLayoutGroups(one, GroupedTensors(), "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateLayoutGroups(TwoGroups(), GroupedTensors(), "").ok());
  // More groups than the layout uses are fine.
  JobSettings three = TwoGroups();
  three.param_groups.push_back(ParamGroupSettings{});
  EXPECT_TRUE(ParseJobSpec(ToJobSpec(three, GroupedTensors())).ok());
}

// A rank registering the same job with other groups, a tensor frozen or in
// another group, or other aliases: the difference names what differs.
TEST(JobSpecTest, SpecDifferenceNamesGroupsFrozenFlagsAndAliases) {
  const v1::JobSpec registered = ToJobSpec(TwoGroups(), GroupedTensors());
  {
    JobSettings s = TwoGroups();
    s.param_groups[1].lr = 0.125f;
    const std::string d = DescribeSpecDifference(registered, ToJobSpec(s, GroupedTensors()));
    EXPECT_EQ(d.rfind("param_groups: registered ", 0), 0u) << d;
    EXPECT_NE(d.find("0.125"), std::string::npos) << d;
    // A group fewer.
    v1::JobSpec fewer = registered;
    fewer.mutable_param_groups()->RemoveLast();
    const std::string f = DescribeSpecDifference(registered, fewer);
    EXPECT_EQ(f.rfind("param_groups: registered ", 0), 0u) << f;
  }
  struct Case {
    void (*mutate)(std::vector<TensorSpec>&);
    const char* expected;
  };
  const Case cases[] = {
      {[](std::vector<TensorSpec>& t) { t[1].group = 0; },
       "layout.tensors[1] 'b': registered in parameter group 1, got group 0"},
      {[](std::vector<TensorSpec>& t) { t[2].frozen = false; },
       "layout.tensors[2] 'buf': registered frozen, got trainable"},
      {[](std::vector<TensorSpec>& t) { t[0].frozen = true; },
       "layout.tensors[0] 'w': registered trainable, got frozen"},
      {[](std::vector<TensorSpec>& t) { t[1].aliases = {"b_tied", "b2"}; },
       "layout.tensors[1] 'b': registered aliases [b_tied], got [b_tied, b2]"},
      {[](std::vector<TensorSpec>& t) { t[1].aliases.clear(); },
       "layout.tensors[1] 'b': registered aliases [b_tied], got []"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(DescribeSpecDifference(registered, ToJobSpec(TwoGroups(), GroupedTensors(c.mutate))),
              c.expected);
  }
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
