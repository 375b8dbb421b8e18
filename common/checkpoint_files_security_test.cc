// What checkpoint files and directories refuse to other local users: modes,
// links planted where the daemon writes, directories others can change.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

constexpr uid_t kNobody = 65534;

class CheckpointFilesSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zs-checkpoint-security-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    outside_ = root_ + "/outside";
    ASSERT_EQ(::mkdir(outside_.c_str(), 0700), 0);
    victim_ = outside_ + "/victim";
    std::ofstream(victim_) << "untouched";
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  static mode_t Mode(const std::string& path) {
    struct stat st;
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    return st.st_mode & 07777;
  }
  static std::string Contents(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static v1::PartManifest Part() {
    v1::PartManifest p;
    p.set_daemon_index(3);
    p.set_daemon_count(4);
    return p;
  }

  std::string root_;     // mode 0700, this user's
  std::string outside_;  // where a planted link points
  std::string victim_;   // a file a planted link points at
};

TEST_F(CheckpointFilesSecurityTest, FilesAreOwnerOnly) {
  const mode_t old_umask = ::umask(0);  // the modes asked for, not the umask's
  const std::string part = CheckpointPartDir(root_ + "/ckpt", "job", "c", 0);
  const absl::Status made = MakeDirectories(part);
  const std::vector<float> values(10, 1.0f);
  v1::CheckpointFile file;
  const absl::Status array =
      made.ok() ? WriteArrayFile(part, kMasterFile, values.data(), 40, nullptr, &file) : made;
  const absl::Status proto = made.ok() ? WriteProtoFile(part, kPartManifestFile, Part()) : made;
  const absl::Status owner = WriteCheckpointOwner(root_ + "/ckpt", "job2", "ab");
  ::umask(old_umask);
  ASSERT_TRUE(made.ok()) << made;
  ASSERT_TRUE(array.ok()) << array;
  ASSERT_TRUE(proto.ok()) << proto;
  ASSERT_TRUE(owner.ok()) << owner;
  for (const std::string& dir :
       {root_ + "/ckpt", CheckpointJobDir(root_ + "/ckpt", "job"),
        CheckpointDir(root_ + "/ckpt", "job", "c"), part,
        CheckpointJobDir(root_ + "/ckpt", "job2")}) {
    EXPECT_EQ(Mode(dir), 0700u) << dir;
  }
  for (const std::string& f :
       {part + "/" + kMasterFile, part + "/" + kPartManifestFile,
        CheckpointJobDir(root_ + "/ckpt", "job2") + "/" + kCheckpointOwnerFile}) {
    EXPECT_EQ(Mode(f), 0600u) << f;
  }
}

// Temporary names were once host.pid.sequence: anyone could plant links at
// them in advance. Links at every such name and at the final name are left
// alone, and what they point at is unchanged.
TEST_F(CheckpointFilesSecurityTest, LinksAtTemporaryAndFinalNamesAreNotFollowed) {
  const std::string dir = root_ + "/d";
  ASSERT_TRUE(MakeDirectories(dir).ok());
  char host[64] = {};
  ::gethostname(host, sizeof(host) - 1);
  for (int seq = 0; seq < 2000; ++seq) {
    const std::string link =
        absl::StrCat(dir, "/.", kManifestFile, ".tmp.", host, ".", ::getpid(), ".", seq);
    ASSERT_EQ(::symlink(victim_.c_str(), link.c_str()), 0) << link;
  }
  const std::string second_victim = outside_ + "/second";
  std::ofstream(second_victim) << "untouched";
  const std::string final_name = absl::StrCat(dir, "/", kManifestFile);
  ASSERT_EQ(::symlink(second_victim.c_str(), final_name.c_str()), 0);

  const absl::Status s = WriteProtoFile(dir, kManifestFile, Part());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Contents(victim_), "untouched");
  EXPECT_EQ(Contents(second_victim), "untouched");
  struct stat st;
  ASSERT_EQ(::lstat(final_name.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the link at the final name was replaced, not followed";
  v1::PartManifest back;
  EXPECT_TRUE(ReadProtoFile(final_name, &back).ok());
  EXPECT_EQ(back.daemon_index(), 3u);
}

TEST_F(CheckpointFilesSecurityTest, ReadsRefuseALinkAtAFileName) {
  const std::string job = CheckpointJobDir(root_, "job");
  ASSERT_TRUE(MakeDirectories(job).ok());
  const std::string owner = job + "/" + kCheckpointOwnerFile;
  ASSERT_EQ(::symlink(victim_.c_str(), owner.c_str()), 0);
  absl::StatusOr<std::string> read = ReadCheckpointOwner(root_, "job");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << read.status();
  EXPECT_NE(read.status().message().find(owner), std::string::npos) << read.status();
  v1::PartManifest p;
  EXPECT_EQ(ReadProtoFile(owner, &p).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CheckpointFilesSecurityTest, RefusesADirectoryOthersCanWrite) {
  const std::string open = root_ + "/open";
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  for (const std::string& path : {open, open + "/job"}) {
    const absl::Status s = MakeDirectories(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << path << ": " << s;
    EXPECT_NE(s.message().find(absl::StrCat(open, " is writable by group or others")),
              std::string::npos)
        << s;
    EXPECT_NE(s.message().find(absl::StrCat("chmod go-w ", open)), std::string::npos) << s;
  }
  EXPECT_FALSE(std::filesystem::exists(open + "/job"));
  // Sticky (like /tmp): others cannot remove or replace what is not theirs.
  ASSERT_EQ(::chmod(open.c_str(), 01777), 0);
  const absl::Status sticky = MakeDirectories(open + "/job");
  EXPECT_TRUE(sticky.ok()) << sticky;
}

// A directory above the checkpoint directory that others may write into
// lets them replace everything below it, existing directories included.
TEST_F(CheckpointFilesSecurityTest, RefusesAnExistingDirectoryAboveThatOthersCanWrite) {
  const std::string open = root_ + "/open";
  const std::string existing = open + "/existing";
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir(existing.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  for (const std::string& path : {existing, existing + "/job"}) {
    const absl::Status s = MakeDirectories(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << path << ": " << s;
    EXPECT_NE(s.message().find(absl::StrCat(open, " is writable by group or others")),
              std::string::npos)
        << s;
  }
  EXPECT_FALSE(std::filesystem::exists(existing + "/job"));
  ASSERT_EQ(::chmod(open.c_str(), 0700), 0);
  EXPECT_TRUE(MakeDirectories(existing + "/job").ok());
}

TEST_F(CheckpointFilesSecurityTest, RefusesADirectoryOrLinkOfAnotherUser) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to make a directory and a link of uid " << kNobody;
  }
  const std::string theirs = root_ + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  for (const std::string& path : {theirs, theirs + "/job"}) {
    const absl::Status s = MakeDirectories(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << path << ": " << s;
    EXPECT_NE(s.message().find(absl::StrCat(theirs, " is owned by uid ", kNobody)),
              std::string::npos)
        << s;
    EXPECT_NE(s.message().find("chown"), std::string::npos) << s;
  }
  EXPECT_FALSE(std::filesystem::exists(theirs + "/job"));

  // A link planted at a job's directory by another user: the checkpoint is
  // not written through it.
  const std::string ckpt = root_ + "/ckpt";
  ASSERT_TRUE(MakeDirectories(ckpt).ok());
  const std::string job = CheckpointJobDir(ckpt, "job");
  ASSERT_EQ(::symlink(outside_.c_str(), job.c_str()), 0);
  ASSERT_EQ(::lchown(job.c_str(), kNobody, kNobody), 0);
  const absl::Status s = MakeDirectories(CheckpointPartDir(ckpt, "job", "c", 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(absl::StrCat(job, " is a symbolic link owned by uid ", kNobody)),
            std::string::npos)
      << s;
  const absl::Status owner = WriteCheckpointOwner(ckpt, "job", "ab");
  EXPECT_EQ(owner.code(), absl::StatusCode::kFailedPrecondition) << owner;
  EXPECT_FALSE(std::filesystem::exists(outside_ + "/c"));
  EXPECT_FALSE(std::filesystem::exists(outside_ + "/" + kCheckpointOwnerFile));
  EXPECT_EQ(Contents(victim_), "untouched");
}

}  // namespace
}  // namespace zeroshard
