#include "tools/export_lib.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"

namespace zeroshard::tools {
namespace {

// Tensors of awkward sizes over three layers; alignment gaps between them.
Layout TestLayout() {
  std::vector<TensorSpec> specs(4);
  specs[0].name = "embed.weight";
  specs[0].shape = {7, 5};
  specs[1].name = "blocks.0.bias";
  specs[1].shape = {13};
  specs[1].layer = 1;
  specs[2].name = "blocks.0.weight";
  specs[2].shape = {3, 4, 5};
  specs[2].layer = 1;
  specs[3].name = "head.scale";
  specs[3].shape = {1};
  specs[3].layer = 2;
  return Layout::Create(std::move(specs), /*alignment=*/16).value();
}

// What the test writes at flat element i: distinct per element and per step.
float MasterValue(uint64_t i, uint64_t step) { return 0.25f * i + 1000.0f * step + 0.125f; }

// Writes a complete AdamW checkpoint of `layout` at `step` the way daemons
// do: `parts` parts whose ranges cut through tensors, then MANIFEST.
v1::CheckpointManifest WriteCheckpoint(const std::string& root, const std::string& job,
                                       const std::string& name, const Layout& layout,
                                       uint32_t parts, uint64_t step) {
  JobSettings settings;
  settings.job_id = job;
  settings.world_size = parts;
  settings.precision = DType::kFp32;
  for (uint32_t d = 0; d < parts; ++d) settings.daemons.push_back(absl::StrCat("h", d, ":1"));
  v1::CheckpointManifest m;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_job_id(job);
  m.set_name(name);
  *m.mutable_spec() = ToJobSpec(settings, layout);
  const uint64_t total = layout.total_elements();
  m.mutable_partition_map()->set_total_elements(total);
  m.mutable_state()->set_committed_step(step);
  std::vector<float> master(total), zeros(total, 0.0f);
  for (uint64_t i = 0; i < total; ++i) master[i] = MasterValue(i, step);
  for (uint32_t d = 0; d < parts; ++d) {
    const uint64_t begin = total * d / parts, end = total * (d + 1) / parts;
    v1::PartManifest* p = m.add_parts();
    p->set_daemon_index(d);
    p->set_daemon_count(parts);
    p->mutable_range()->set_begin(begin);
    p->mutable_range()->set_end(end);
    p->mutable_state()->set_committed_step(step);
    const std::string dir = CheckpointPartDir(root, job, name, d);
    EXPECT_TRUE(MakeDirectories(dir).ok());
    const uint64_t bytes = (end - begin) * sizeof(float);
    EXPECT_TRUE(
        WriteArrayFile(dir, kMasterFile, master.data() + begin, bytes, nullptr, p->add_files())
            .ok());
    EXPECT_TRUE(
        WriteArrayFile(dir, kExpAvgFile, zeros.data() + begin, bytes, nullptr, p->add_files())
            .ok());
    EXPECT_TRUE(
        WriteArrayFile(dir, kExpAvgSqFile, zeros.data() + begin, bytes, nullptr, p->add_files())
            .ok());
    EXPECT_TRUE(WriteProtoFile(dir, kPartManifestFile, *p).ok());
  }
  EXPECT_TRUE(WriteProtoFile(CheckpointDir(root, job, name), kManifestFile, m).ok());
  EXPECT_TRUE(CheckManifest(m).ok()) << CheckManifest(m);
  return m;
}

std::vector<char> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// A fresh directory per test.
std::string TestDir(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/export_test_", name);
  EXPECT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
  EXPECT_TRUE(MakeDirectories(dir).ok());
  return dir;
}

// Checks that `file` holds a dict of every tensor of `layout` with the
// values WriteCheckpoint wrote at `step`, in layout order.
void ExpectExported(const std::string& file, const Layout& layout, uint64_t step) {
  const c10::IValue loaded = torch::jit::pickle_load(ReadFile(file));
  ASSERT_TRUE(loaded.isGenericDict()) << loaded.tagKind();
  const c10::impl::GenericDict dict = loaded.toGenericDict();
  ASSERT_EQ(dict.size(), layout.tensors().size());
  size_t i = 0;
  for (const auto& entry : dict) {
    const TensorPlacement& p = layout.tensors()[i++];
    ASSERT_EQ(entry.key().toStringRef(), p.spec.name);
    const at::Tensor t = entry.value().toTensor();
    EXPECT_EQ(t.scalar_type(), at::kFloat) << p.spec.name;
    EXPECT_EQ(t.sizes().vec(), p.spec.shape) << p.spec.name;
    ASSERT_TRUE(t.is_contiguous());
    const float* v = t.data_ptr<float>();
    for (uint64_t e = 0; e < p.numel; ++e) {
      ASSERT_EQ(v[e], MasterValue(p.offset + e, step)) << p.spec.name << " element " << e;
    }
  }
}

TEST(Export, WritesEveryTensorOfTheLayoutWithItsShape) {
  const std::string root = TestDir("every");
  const Layout layout = TestLayout();
  WriteCheckpoint(root, "job-a", "step-3", layout, 3, 3);
  const std::string out = absl::StrCat(root, "/model.pt");
  ExportOptions o;
  o.checkpoint = absl::StrCat(root, "/job-a/step-3/");
  o.out = out;
  absl::StatusOr<std::string> summary = RunExport(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_TRUE(absl::StrContains(*summary, "job-a/step-3 (step 3)")) << *summary;
  EXPECT_TRUE(absl::StrContains(*summary, "4 tensors")) << *summary;
  ExpectExported(out, layout, 3);
  EXPECT_FALSE(Exists(absl::StrCat(out, ".tmp-", ::getpid())));
}

TEST(Export, ReadsTensorsLargerThanTheWindowAndAcrossWindows) {
  const std::string root = TestDir("window");
  const Layout layout = TestLayout();
  const v1::CheckpointManifest m = WriteCheckpoint(root, "job-w", "c", layout, 2, 1);
  for (uint64_t window : {1, 13, 20, 64, 1000}) {
    SCOPED_TRACE(window);
    uint64_t bytes_read = 0;
    auto tensors = ReadMasterTensors(root, m, &bytes_read, window);
    ASSERT_TRUE(tensors.ok()) << tensors.status();
    EXPECT_GT(bytes_read, 0u);
    const std::string out = absl::StrCat(root, "/w", window, ".pt");
    ASSERT_TRUE(WriteTensorDict(out, *tensors).ok());
    ExpectExported(out, layout, 1);
  }
}

TEST(Export, WritesATiedTensorUnderEveryName) {
  const std::string root = TestDir("tied");
  std::vector<TensorSpec> specs(2);
  specs[0].name = "wte.weight";
  specs[0].shape = {6, 4};
  specs[0].aliases = {"lm_head.weight"};
  specs[1].name = "norm.running_mean";  // a buffer, kept as a frozen tensor
  specs[1].shape = {4};
  specs[1].frozen = true;
  const Layout layout = Layout::Create(std::move(specs)).value();
  const v1::CheckpointManifest m = WriteCheckpoint(root, "job-t", "c", layout, 2, 5);
  auto tensors = ReadMasterTensors(root, m, nullptr);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 3u);
  EXPECT_EQ((*tensors)[0].first, "wte.weight");
  EXPECT_EQ((*tensors)[1].first, "lm_head.weight");
  EXPECT_EQ((*tensors)[2].first, "norm.running_mean");
  EXPECT_TRUE((*tensors)[0].second.is_same((*tensors)[1].second));
  EXPECT_EQ((*tensors)[1].second.data_ptr<float>()[5], MasterValue(5, 5));
}

TEST(Export, LatestIsTheHighestStep) {
  const std::string root = TestDir("latest");
  const Layout layout = TestLayout();
  WriteCheckpoint(root, "job-l", "zz-early", layout, 1, 2);
  WriteCheckpoint(root, "job-l", "aa-late", layout, 2, 9);
  ExportOptions o;
  o.checkpoint = absl::StrCat(root, "/job-l/latest");
  o.out = absl::StrCat(root, "/latest.pt");
  absl::StatusOr<std::string> summary = RunExport(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_TRUE(absl::StrContains(*summary, "job-l/aa-late (step 9)")) << *summary;
  ExpectExported(o.out, layout, 9);
}

TEST(Export, SplitsCheckpointPaths) {
  auto p = SplitCheckpointPath("/ckpt/dir/run42/step-1000//");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->root, "/ckpt/dir");
  EXPECT_EQ(p->job_id, "run42");
  EXPECT_EQ(p->name, "step-1000");
  p = SplitCheckpointPath("run42/latest");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->root, ".");
  EXPECT_EQ(p->name, "latest");
  p = SplitCheckpointPath("/run42/a");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->root, "/");
  for (const char* bad : {"", "/", "step-1", "/step-1", "dir/bad job/step-1", "dir/run42/..",
                          "dir/run42/a:b"}) {
    SCOPED_TRACE(bad);
    p = SplitCheckpointPath(bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(p.status().message(), "--checkpoint")) << p.status();
  }
}

TEST(Export, RejectsBadInputAndLeavesTheOutputAlone) {
  const std::string root = TestDir("bad");
  const Layout layout = TestLayout();
  WriteCheckpoint(root, "job-b", "good", layout, 2, 4);
  const std::string out = absl::StrCat(root, "/out.pt");
  { std::ofstream(out) << "previous"; }
  auto run = [&](const std::string& checkpoint, const std::string& to) {
    ExportOptions o;
    o.checkpoint = checkpoint;
    o.out = to;
    return RunExport(o).status();
  };

  absl::Status s = run("", out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "--checkpoint")) << s;
  s = run(absl::StrCat(root, "/job-b/good"), "");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "--out")) << s;
  s = run(absl::StrCat(root, "/job-b/good"), absl::StrCat(root, "/no/such/dir/m.pt"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "--out")) << s;

  s = run(absl::StrCat(root, "/job-b/missing"), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  s = run(absl::StrCat(root, "/job-none/latest"), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;

  // Incomplete: no MANIFEST.
  WriteCheckpoint(root, "job-b", "partial", layout, 2, 5);
  ASSERT_EQ(::unlink(absl::StrCat(CheckpointDir(root, "job-b", "partial"), "/", kManifestFile)
                         .c_str()),
            0);
  s = run(absl::StrCat(root, "/job-b/partial"), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "incomplete")) << s;

  // A part file missing here: named.
  WriteCheckpoint(root, "job-b", "gone", layout, 2, 6);
  const std::string gone = absl::StrCat(CheckpointPartDir(root, "job-b", "gone", 1), "/", kMasterFile);
  ASSERT_EQ(::unlink(gone.c_str()), 0);
  s = run(absl::StrCat(root, "/job-b/gone"), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), gone)) << s;

  // One flipped byte in a master file: DataLoss naming it.
  const std::string file = absl::StrCat(CheckpointPartDir(root, "job-b", "good", 1), "/", kMasterFile);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');
  }
  s = run(absl::StrCat(root, "/job-b/good"), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), file)) << s;

  // None of the failures touched the existing output or left a temporary.
  const std::vector<char> previous = ReadFile(out);
  EXPECT_EQ(std::string(previous.begin(), previous.end()), "previous");
  EXPECT_FALSE(Exists(absl::StrCat(out, ".tmp-", ::getpid())));
}

}  // namespace
}  // namespace zeroshard::tools
