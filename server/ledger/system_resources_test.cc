#include "server/ledger/system_resources.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(ParseMemoryLimit, AcceptsBytesAndPowersOf1024) {
  EXPECT_EQ(*ParseMemoryLimit("0", "--memory_limit"), 0u);
  EXPECT_EQ(*ParseMemoryLimit("12345", "--memory_limit"), 12345u);
  EXPECT_EQ(*ParseMemoryLimit("4K", "--memory_limit"), 4096u);
  EXPECT_EQ(*ParseMemoryLimit("4KiB", "--memory_limit"), 4096u);
  EXPECT_EQ(*ParseMemoryLimit("3M", "--memory_limit"), 3u << 20);
  EXPECT_EQ(*ParseMemoryLimit("3MiB", "--memory_limit"), 3u << 20);
  EXPECT_EQ(*ParseMemoryLimit("64G", "--memory_limit"), 64 * kGiB);
  EXPECT_EQ(*ParseMemoryLimit("64GiB", "--memory_limit"), 64 * kGiB);
  EXPECT_EQ(*ParseMemoryLimit("2T", "--memory_limit"), 2048 * kGiB);
  EXPECT_EQ(*ParseMemoryLimit("2TiB", "--memory_limit"), 2048 * kGiB);
  EXPECT_EQ(*ParseMemoryLimit("18446744073709551615", "--memory_limit"), ~uint64_t{0});
  EXPECT_EQ(*ParseMemoryLimit("16777215T", "--memory_limit"), uint64_t{16777215} << 40);
}

TEST(ParseMemoryLimit, AutoIsNinetyPercentOfWhatTheMachineAllows) {
  const absl::StatusOr<uint64_t> limit = ParseMemoryLimit("auto", "--memory_limit");
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_EQ(*limit, AutoMemoryLimit());
  EXPECT_GT(*limit, 0u);
  EXPECT_LE(*limit, PhysicalMemoryBytes() / 10 * 9);
}

TEST(ParseMemoryLimit, RefusesAnythingElseNamingTheFlag) {
  for (const char* bad :
       {"", "-1", "1.5G", "10 G", " 10", "10G ", "10KB", "10k", "10g", "G", "auto ", "max", "0x10",
        "1e9", "10GiBs", "18446744073709551616", "16777216T", "99999999999999999999999"}) {
    const absl::StatusOr<uint64_t> limit = ParseMemoryLimit(bad, "--memory_limit");
    ASSERT_FALSE(limit.ok()) << "\"" << bad << "\" parsed as " << *limit;
    EXPECT_EQ(limit.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(limit.status().message().find("--memory_limit"), absl::string_view::npos);
    EXPECT_NE(limit.status().message().find("auto"), absl::string_view::npos);
  }
}

TEST(MeminfoTotalBytes, ReadsMemTotal) {
  EXPECT_EQ(MeminfoTotalBytes("MemTotal:       16318496 kB\nMemFree:  1 kB\n"),
            uint64_t{16318496} << 10);
  EXPECT_EQ(MeminfoTotalBytes("MemFree: 1 kB\nMemTotal: 2 kB\n"), 2048u);
  EXPECT_EQ(MeminfoTotalBytes("MemFree: 1 kB\n"), 0u);
  EXPECT_EQ(MeminfoTotalBytes("MemTotal: lots\n"), 0u);
  EXPECT_GT(PhysicalMemoryBytes(), 0u);
}

// A fake cgroup mount under TEST_TMPDIR.
class CgroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    root_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/cgroup-",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    Mkdir(root_);
  }

  void Mkdir(const std::string& dir) {
    for (size_t i = 0; i <= dir.size(); ++i) {
      if (i == dir.size() || (dir[i] == '/' && i > 0)) ::mkdir(dir.substr(0, i).c_str(), 0755);
    }
  }

  // Writes `text` to root_/relative, creating its directories.
  void Write(const std::string& relative, const std::string& text) {
    const std::string path = absl::StrCat(root_, "/", relative);
    Mkdir(path.substr(0, path.rfind('/')));
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr) << path;
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }

  std::string root_;
};

TEST_F(CgroupTest, V2TakesTheSmallestMemoryMaxAlongThePath) {
  Write("user.slice/memory.max", "8589934592\n");
  Write("user.slice/job-7/memory.max", "max\n");
  Write("user.slice/job-7/task/memory.max", "max\n");
  EXPECT_EQ(CgroupMemoryLimit("0::/user.slice/job-7/task\n", root_), 8 * kGiB);
  Write("user.slice/job-7/task/memory.max", "1073741824\n");
  EXPECT_EQ(CgroupMemoryLimit("0::/user.slice/job-7/task\n", root_), kGiB);
}

TEST_F(CgroupTest, V2WithoutALimitIsNone) {
  Write("a/memory.max", "max\n");
  EXPECT_EQ(CgroupMemoryLimit("0::/a\n", root_), 0u);
  EXPECT_EQ(CgroupMemoryLimit("0::/missing/entirely\n", root_), 0u);
  EXPECT_EQ(CgroupMemoryLimit("", root_), 0u);
  EXPECT_EQ(CgroupMemoryLimit("garbage\n0:x\n", root_), 0u);
  EXPECT_EQ(CgroupMemoryLimit("0::/a/../../etc\n", root_), 0u);
}

TEST_F(CgroupTest, V2InAContainerReadsTheMountRoot) {
  // The path names the host's hierarchy; the container sees its own cgroup
  // mounted at the root.
  Write("memory.max", "536870912\n");
  EXPECT_EQ(CgroupMemoryLimit("0::/system.slice/docker-abc.scope\n", root_), 512u << 20);
}

TEST_F(CgroupTest, V1ReadsTheMemoryController) {
  Write("memory/memory.limit_in_bytes", "9223372036854771712\n");
  Write("memory/docker/abc/memory.limit_in_bytes", "2147483648\n");
  const std::string self =
      "12:cpu,cpuacct:/docker/abc\n"
      "11:memory:/docker/abc\n"
      "1:name=systemd:/docker/abc\n";
  EXPECT_EQ(CgroupMemoryLimit(self, root_), 2 * kGiB);
  // Unlimited everywhere.
  Write("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(CgroupMemoryLimit(self, root_), 0u);
}

TEST_F(CgroupTest, HybridTakesTheSmallerOfBoth) {
  Write("memory/job/memory.limit_in_bytes", "4294967296\n");
  Write("job/memory.max", "3221225472\n");
  EXPECT_EQ(CgroupMemoryLimit("5:memory:/job\n0::/job\n", root_), 3 * kGiB);
}

TEST_F(CgroupTest, V2CpuMaxIsQuotaOverPeriodSmallestAlongThePath) {
  Write("cpu.max", "max 100000\n");
  Write("kubepods/cpu.max", "400000 100000\n");
  Write("kubepods/pod1/cpu.max", "150000 100000\n");
  EXPECT_DOUBLE_EQ(CgroupCpuLimit("0::/kubepods/pod1\n", root_), 1.5);
  Write("kubepods/pod1/cpu.max", "max 100000\n");
  EXPECT_DOUBLE_EQ(CgroupCpuLimit("0::/kubepods/pod1\n", root_), 4.0);
  Write("kubepods/cpu.max", "max 100000\n");
  EXPECT_EQ(CgroupCpuLimit("0::/kubepods/pod1\n", root_), 0.0);
  Write("kubepods/pod1/cpu.max", "garbage\n");
  EXPECT_EQ(CgroupCpuLimit("0::/kubepods/pod1\n", root_), 0.0);
  EXPECT_EQ(CgroupCpuLimit("0::/kubepods/../..\n", root_), 0.0);
}

TEST_F(CgroupTest, V1CpuQuotaUnderTheControllersMount) {
  Write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n");
  Write("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  Write("cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  Write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const std::string self = "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n";
  EXPECT_DOUBLE_EQ(CgroupCpuLimit(self, root_), 2.5);
  Write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(CgroupCpuLimit(self, root_), 0.0);
}

TEST(ParseCpuList, TakesListsAndRangesOfAllowedCpus) {
  const std::vector<int> allowed = {0, 1, 2, 3, 8, 10, 11};
  EXPECT_EQ(*ParseCpuList("0-3,8", allowed, "--cpus"), (std::vector<int>{0, 1, 2, 3, 8}));
  EXPECT_EQ(*ParseCpuList(" 11,2 ", allowed, "--cpus"), (std::vector<int>{2, 11}));
  EXPECT_EQ(*ParseCpuList("10-10", allowed, "--cpus"), (std::vector<int>{10}));
  EXPECT_EQ(*ParseCpuList("all", allowed, "--cpus"), allowed);
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({}), "");
}

TEST(ParseCpuList, RefusesAnythingElseNamingTheFlagAndTheAllowedCpus) {
  const std::vector<int> allowed = {0, 1, 2, 3};
  for (const char* bad : {"", "x", "1-", "-1", "3-1", "0,,1", "0-9999999999", "4", "2-5",
                          "1,1", "0-2,2", "1.5"}) {
    absl::StatusOr<std::vector<int>> got = ParseCpuList(bad, allowed, "--cpus");
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("--cpus: ")) << bad;
    EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("(0-3)")) << bad;
  }
  EXPECT_FALSE(ParseCpuList("all", {}, "--cpus").ok());
  // Bounded however large the mask.
  std::vector<int> many(1000);
  for (int i = 0; i < 1000; ++i) many[i] = i;
  EXPECT_EQ(ParseCpuList("all", many, "--cpus")->size(), kMaxListedCpus);
  EXPECT_FALSE(ParseCpuList("0-999", many, "--cpus").ok());
}

TEST(AffinityCpuList, IsTheAffinityMask) {
  const std::vector<int> cpus = AffinityCpuList();
  EXPECT_EQ(static_cast<int>(cpus.size()), AffinityCpus());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
}

TEST(UsableCpus, IsAtLeastOneAndAtMostTheAffinityMask) {
  const int cpus = UsableCpus();
  EXPECT_GE(cpus, 1);
  if (AffinityCpus() > 0) EXPECT_LE(cpus, AffinityCpus());
}

TEST(AutoMemoryLimit, IsAtMostNinetyPercentOfThisProcessesCgroupAndMachine) {
  const uint64_t limit = AutoMemoryLimit();
  EXPECT_GT(limit, 0u);
  EXPECT_LE(limit, PhysicalMemoryBytes() / 10 * 9);
}

}  // namespace
}  // namespace zeroshard
