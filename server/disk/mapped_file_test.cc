#include "server/disk/mapped_file.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

class MappedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zs-mapped-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    absl::StatusOr<std::unique_ptr<InstanceDirectory>> d =
        InstanceDirectory::Open(root_ + "/states", InstanceDirectory::StateNaming());
    ASSERT_TRUE(d.ok()) << d.status();
    dir_ = *std::move(d);
  }
  void TearDown() override {
    dir_.reset();
    std::filesystem::remove_all(root_);
  }
  size_t DataFiles() const {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(root_ + "/states")) {
      if (e.path().filename().string().find(".lock") == std::string::npos) ++n;
    }
    return n;
  }

  std::string root_;
  std::unique_ptr<InstanceDirectory> dir_;
};

TEST_F(MappedFileTest, ZeroFilledOwnerOnlyWrittenThroughAndRemoved) {
  constexpr uint64_t kBytes = 8 << 20;
  std::string path;
  {
    absl::StatusOr<std::unique_ptr<MappedFile>> f = MappedFile::Create(dir_.get(), kBytes);
    ASSERT_TRUE(f.ok()) << f.status();
    path = (*f)->path();
    EXPECT_EQ((*f)->size(), kBytes);
    const char* bytes = static_cast<const char*>((*f)->data());
    for (uint64_t i = 0; i < kBytes; i += 4096) ASSERT_EQ(bytes[i], 0) << i;
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBytes);
    EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kBytes);  // allocated
    // What is written lands in the file.
    std::memset((*f)->data(), 0x5a, 4096);
    ASSERT_EQ(::msync((*f)->data(), 4096, MS_SYNC), 0);
    FILE* in = std::fopen(path.c_str(), "rb");
    ASSERT_NE(in, nullptr);
    char first = 0;
    ASSERT_EQ(std::fread(&first, 1, 1, in), 1u);
    std::fclose(in);
    EXPECT_EQ(first, 0x5a);
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(DataFiles(), 0u);
}

TEST_F(MappedFileTest, ADiskWithoutRoomIsResourceExhaustedAndLeavesNothing) {
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  absl::StatusOr<std::unique_ptr<MappedFile>> f = MappedFile::Create(dir_.get(), 64 << 20);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
  EXPECT_NE(f.status().message().find(root_), std::string::npos) << f.status();
  EXPECT_EQ(DataFiles(), 0u);
}

}  // namespace
}  // namespace zeroshard
