#include "common/checkpoint_files.h"

#include <iterator>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <vector>

#include "common/crc32c.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

class CheckpointFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zs-checkpoint-files-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // Writes a complete checkpoint `name` of `total` elements (element i of
  // array f holds i + f * 0.5) in parts cut at `cuts`, at `step`.
  v1::CheckpointManifest Write(const std::string& name, uint64_t total,
                               const std::vector<uint64_t>& cuts, uint64_t step,
                               bool manifest = true) {
    v1::CheckpointManifest m;
    m.set_format_version(kCheckpointFormatVersion);
    m.set_job_id("job");
    m.set_name(name);
    m.mutable_spec()->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_ADAMW);
    SetLayout(m.mutable_spec(), total);
    m.mutable_partition_map()->set_total_elements(total);
    m.mutable_state()->set_committed_step(step);
    std::vector<uint64_t> bounds = {0};
    bounds.insert(bounds.end(), cuts.begin(), cuts.end());
    bounds.push_back(total);
    const std::vector<std::string> files = ArrayFilesOf(m.spec());
    for (size_t d = 0; d + 1 < bounds.size(); ++d) {
      v1::PartManifest* p = m.add_parts();
      p->set_daemon_index(static_cast<uint32_t>(d));
      p->set_daemon_count(static_cast<uint32_t>(bounds.size() - 1));
      p->mutable_range()->set_begin(bounds[d]);
      p->mutable_range()->set_end(bounds[d + 1]);
      p->mutable_state()->set_committed_step(step);
      const std::string dir = CheckpointPartDir(root_, "job", name, static_cast<uint32_t>(d));
      EXPECT_TRUE(MakeDirectories(dir).ok());
      for (size_t f = 0; f < files.size(); ++f) {
        std::vector<float> values(bounds[d + 1] - bounds[d]);
        for (size_t i = 0; i < values.size(); ++i) values[i] = (bounds[d] + i) + f * 0.5f;
        std::atomic<uint64_t> progress{0};
        EXPECT_TRUE(WriteArrayFile(dir, files[f], values.data(), values.size() * 4, &progress,
                                   p->add_files())
                        .ok());
        EXPECT_EQ(progress.load(), values.size() * 4);
      }
      EXPECT_TRUE(WriteProtoFile(dir, kPartManifestFile, *p).ok());
    }
    if (manifest) {
      EXPECT_TRUE(CheckManifest(m).ok()) << CheckManifest(m);
      EXPECT_TRUE(WriteProtoFile(CheckpointDir(root_, "job", name), kManifestFile, m).ok());
    }
    return m;
  }

  // One fp32 tensor of `total` elements, unaligned: its flat space is `total`.
  static void SetLayout(v1::JobSpec* spec, uint64_t total) {
    spec->mutable_layout()->Clear();
    spec->mutable_layout()->set_alignment_elements(1);
    v1::TensorSpec* t = spec->mutable_layout()->add_tensors();
    t->set_name("w");
    t->add_shape(static_cast<int64_t>(total));
    t->set_dtype(v1::DTYPE_FP32);
  }

  void Rewrite(const v1::CheckpointManifest& m) {
    ASSERT_TRUE(WriteProtoFile(CheckpointDir(root_, "job", m.name()), kManifestFile, m).ok());
  }

  std::string root_;
};

// An array file written from pieces of odd sizes, across block boundaries,
// is the file written from one buffer: the same bytes, CRC and block CRCs.
// Pieces that do not add up to the size leave nothing.
TEST_F(CheckpointFilesTest, PiecesWriteTheSameFileAsOneBuffer) {
  const uint64_t bytes = 2 * kCheckpointBlockBytes + 12345;
  std::string data(bytes, '\0');
  for (uint64_t i = 0; i < bytes; ++i) data[i] = static_cast<char>((i * 131) >> 3);
  v1::CheckpointFile whole, pieces;
  ASSERT_TRUE(WriteArrayFile(root_, "whole", data.data(), bytes, nullptr, &whole).ok());
  std::atomic<uint64_t> progress{0};
  ASSERT_TRUE(WriteArrayFileFrom(root_, "pieces", bytes, &progress, &pieces,
                                 [&](ArraySink sink) -> absl::Status {
                                   uint64_t off = 0;
                                   for (uint64_t k = 1; off < bytes; k = k * 3 + 7) {
                                     const uint64_t n = std::min(k, bytes - off);
                                     if (absl::Status s = sink(data.data() + off, n); !s.ok()) {
                                       return s;
                                     }
                                     off += n;
                                   }
                                   return absl::OkStatus();
                                 })
                  .ok());
  EXPECT_EQ(progress.load(), bytes);
  EXPECT_EQ(pieces.crc32c(), whole.crc32c());
  ASSERT_EQ(pieces.block_crc32c_size(), 3);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(pieces.block_crc32c(b), whole.block_crc32c(b)) << b;
  std::ifstream in(root_ + "/pieces", std::ios::binary);
  const std::string read((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(read, data);
  v1::CheckpointFile short_file;
  const absl::Status s = WriteArrayFileFrom(root_, "short", bytes, nullptr, &short_file,
                                            [&](ArraySink sink) { return sink(data.data(), 10); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_FALSE(std::filesystem::exists(root_ + "/short"));
}

TEST_F(CheckpointFilesTest, NamesFollowTheRule) {
  EXPECT_TRUE(ValidateCheckpointName("step-20", false).ok());
  EXPECT_TRUE(ValidateCheckpointName("latest", true).ok());
  for (const char* bad : {"", ".", "..", "a/b", "../x", "latest", "a b"}) {
    EXPECT_EQ(ValidateCheckpointName(bad, false).code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(ValidateCheckpointName(std::string(129, 'x'), true).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointFilesTest, ReadsAnyRangeAcrossPartsAndBlocks) {
  // Parts larger than a CRC block, cut at odd places.
  const uint64_t total = 2'600'003;
  Write("c", total, {1'100'001, 1'100'002}, 7);
  absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(root_, "job", "c");
  ASSERT_TRUE(m.ok()) << m.status();
  CheckpointReader reader(root_, *m);
  for (const FlatRange r : {FlatRange{0, total}, FlatRange{1'048'570, 1'048'590},
                            FlatRange{1'100'000, 1'100'003}, FlatRange{2'599'999, total}}) {
    ASSERT_TRUE(reader.CheckReadable(r, {kExpAvgSqFile}).ok());
    std::vector<float> out(r.size());
    uint64_t bytes = 0;
    ASSERT_TRUE(reader.ReadRange(kExpAvgSqFile, r, out.data(), &bytes).ok());
    for (uint64_t i = r.begin; i < r.end; ++i) {
      ASSERT_EQ(out[i - r.begin], static_cast<float>(i) + 1.0f) << i;
    }
    EXPECT_GE(bytes, r.size() * 4);
  }
  uint64_t bytes = 0;
  for (uint32_t d = 0; d < 3; ++d) EXPECT_TRUE(reader.VerifyPart(d, &bytes).ok());
  EXPECT_EQ(bytes, total * 4 * 3);
}

TEST_F(CheckpointFilesTest, CorruptionIsDataLossNamingTheFileAndBlock) {
  Write("c", 1'200'000, {}, 1);
  const std::string path = CheckpointPartDir(root_, "job", "c", 0) + "/" + kMasterFile;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4'300'000);  // block 1
    f.put('\x01');
  }
  CheckpointReader reader(root_, *ReadManifest(root_, "job", "c"));
  std::vector<float> out(10);
  absl::Status s = reader.ReadRange(kMasterFile, {1'075'000, 1'075'010}, out.data(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("master.f32 block 1"), std::string::npos) << s;
  // Block 0 is intact and still reads.
  EXPECT_TRUE(reader.ReadRange(kMasterFile, {0, 10}, out.data(), nullptr).ok());
  EXPECT_EQ(reader.VerifyPart(0, nullptr).code(), absl::StatusCode::kDataLoss);
  // A manifest that does not parse.
  std::ofstream(CheckpointDir(root_, "job", "c") + "/MANIFEST") << "garbage";
  EXPECT_EQ(ReadManifest(root_, "job", "c").status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(CheckpointFilesTest, IncompleteCheckpointsListWhatIsMissing) {
  Write("half", 1000, {400, 700}, 3, /*manifest=*/false);
  std::filesystem::remove_all(CheckpointPartDir(root_, "job", "half", 1));
  absl::Status s = ReadManifest(root_, "job", "half").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("written: part-0 (step 3), part-2 (step 3); missing: part-1"),
            std::string::npos)
      << s;
  EXPECT_EQ(ReadManifest(root_, "job", "none").status().code(), absl::StatusCode::kNotFound);
}

// A block size of 2^62 in a MANIFEST: refused with the field named, before
// any reader allocates a block of it.
TEST_F(CheckpointFilesTest, HostileBlockBytesIsDataLossWithoutAllocating) {
  v1::CheckpointManifest m = Write("c", 1000, {400}, 2);
  m.mutable_parts(1)->mutable_files(2)->set_block_bytes(uint64_t{1} << 62);
  Rewrite(m);
  absl::Status s = ReadManifest(root_, "job", "c").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("MANIFEST part 1 file 2 (exp_avg_sq.f32) has block_bytes "
                             "4611686018427387904, outside 1..67108864"),
            std::string::npos)
      << s;
  // A reader given the manifest anyway checks each file before reading it.
  CheckpointReader reader(root_, m);
  s = reader.VerifyPart(1, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("part-1/exp_avg_sq.f32: the manifest says block_bytes"),
            std::string::npos)
      << s;
  std::vector<float> out(10);
  s = reader.ReadRange(kExpAvgSqFile, {500, 510}, out.data(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("block_bytes"), std::string::npos) << s;
  // The other part and the other files still verify.
  EXPECT_TRUE(reader.VerifyPart(0, nullptr).ok());
  EXPECT_TRUE(reader.ReadRange(kMasterFile, {500, 510}, out.data(), nullptr).ok());
}

// Lengths whose sums and products wrap around 2^64: a part of 2^62 - 1
// elements claims 2^64 - 4 bytes (its range times 4, wrapped) and no block
// CRC (2^64 - 4 + block_bytes - 1, wrapped, is less than one block).
TEST_F(CheckpointFilesTest, LengthsNearUint64MaxAreDataLoss) {
  v1::CheckpointManifest m = Write("c", 1000, {}, 2);
  const uint64_t elements = (uint64_t{1} << 62) - 1;
  m.mutable_partition_map()->set_total_elements(elements);
  m.mutable_parts(0)->mutable_range()->set_end(elements);
  for (v1::CheckpointFile& f : *m.mutable_parts(0)->mutable_files()) {
    f.set_bytes(elements * 4);  // 2^64 - 4
    f.clear_block_crc32c();
  }
  Rewrite(m);
  absl::Status s = ReadManifest(root_, "job", "c").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("partition_map.total_elements is 4611686018427387903, the spec's "
                             "layout has 1000"),
            std::string::npos)
      << s;
  CheckpointReader reader(root_, m);
  s = reader.VerifyPart(0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("master.f32: has 4000 bytes, the manifest says 18446744073709551612"),
            std::string::npos)
      << s;
  std::vector<float> out(64);
  s = reader.ReadRange(kMasterFile, {0, 64}, out.data(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("18446744073709551612"), std::string::npos) << s;
}

// partition_map.total_elements is the spec's: a map over another flat space
// (its parts tiling it, their files sized to it) is refused.
TEST_F(CheckpointFilesTest, TotalElementsNotTheSpecsIsDataLoss) {
  v1::CheckpointManifest m = Write("c", 1000, {400}, 2);
  SetLayout(m.mutable_spec(), 2000);
  Rewrite(m);
  absl::Status s = ReadManifest(root_, "job", "c").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("MANIFEST partition_map.total_elements is 1000, the spec's layout "
                             "has 2000"),
            std::string::npos)
      << s;
  // A spec whose layout is no layout.
  m.mutable_spec()->clear_layout();
  Rewrite(m);
  s = ReadManifest(root_, "job", "c").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("MANIFEST spec: "), std::string::npos) << s;
}

// An incomplete checkpoint whose PART file claims 2^32 - 1 daemons: the
// message lists a bounded number of missing parts.
TEST_F(CheckpointFilesTest, HostileDaemonCountListsBoundedMissingParts) {
  Write("half", 1000, {400, 700}, 3, /*manifest=*/false);
  const std::string dir = CheckpointPartDir(root_, "job", "half", 0);
  v1::PartManifest part;
  ASSERT_TRUE(ReadProtoFile(dir + "/" + kPartManifestFile, &part).ok());
  part.set_daemon_count(UINT32_MAX);
  ASSERT_TRUE(WriteProtoFile(dir, kPartManifestFile, part).ok());
  absl::Status s = ReadManifest(root_, "job", "half").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // part-3..part-18 listed; 2^32 - 1 - 19 not.
  EXPECT_NE(s.message().find("missing: part-3, part-4"), std::string::npos) << s;
  EXPECT_NE(s.message().find("part-18, and 4294967276 more (4294967295 daemons"),
            std::string::npos)
      << s;
}

TEST_F(CheckpointFilesTest, LatestIsTheHighestCompleteStep) {
  EXPECT_EQ(ResolveCheckpointName(root_, "job", "latest").status().code(),
            absl::StatusCode::kNotFound);
  Write("b", 100, {50}, 20);
  Write("a", 100, {50}, 40);
  Write("c", 100, {50}, 60, /*manifest=*/false);  // incomplete: skipped
  absl::StatusOr<std::vector<v1::CheckpointManifest>> all = ListCompleteCheckpoints(root_, "job");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].name(), "b");
  EXPECT_EQ(*ResolveCheckpointName(root_, "job", "latest"), "a");
  EXPECT_EQ(*ResolveCheckpointName(root_, "job", "b"), "b");
}

TEST_F(CheckpointFilesTest, ManifestsMustTileTheFlatSpace) {
  v1::CheckpointManifest m = Write("t", 100, {50}, 1);
  v1::CheckpointManifest gap = m;
  gap.mutable_parts(1)->mutable_range()->set_begin(51);
  EXPECT_EQ(CheckManifest(gap).code(), absl::StatusCode::kDataLoss);
  v1::CheckpointManifest short_file = m;
  short_file.mutable_parts(0)->mutable_files(0)->set_bytes(196);
  EXPECT_EQ(CheckManifest(short_file).code(), absl::StatusCode::kDataLoss);
  v1::CheckpointManifest steps = m;
  steps.mutable_parts(1)->mutable_state()->set_committed_step(2);
  EXPECT_EQ(CheckManifest(steps).code(), absl::StatusCode::kDataLoss);
  v1::CheckpointManifest version = m;
  version.set_format_version(2);
  EXPECT_EQ(CheckManifest(version).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace zeroshard
