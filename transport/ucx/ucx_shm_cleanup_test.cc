// Shared memory a UCX transport allocates does not outlive its process: a
// peer process (transport_test_peer) allocates a region over posix shared
// memory and is killed with SIGKILL, after its region is allocated or while
// it is being allocated; afterwards no file it had in /dev/shm (or its
// private directory there) may remain.

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace zeroshard::transport::ucx {
namespace {

constexpr char kShmDir[] = "/dev/shm";
constexpr char kTls[] = "posix,cma,self";

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

uint64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

// Paths of UCX's shared-memory files that `pid` holds open or maps, as
// named when it opened them; `live` only those not unlinked yet.
std::set<std::string> ShmFilesOf(pid_t pid, bool live = false) {
  std::set<std::string> out;
  auto take = [&](absl::string_view path) {
    if (!absl::StrContains(path, "/ucx_shm_posix_")) return;
    const bool deleted = absl::ConsumeSuffix(&path, " (deleted)");
    if (!live || !deleted) out.emplace(path);
  };
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* d = ::opendir(fd_dir.c_str()); d != nullptr) {
    while (const dirent* e = ::readdir(d)) {
      char target[4096];
      const ssize_t n =
          ::readlink(absl::StrCat(fd_dir, "/", e->d_name).c_str(), target, sizeof(target));
      if (n > 0) take(absl::string_view(target, static_cast<size_t>(n)));
    }
    ::closedir(d);
  }
  if (std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/maps").c_str(), "r")) {
    char line[8192];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      absl::string_view l = absl::StripTrailingAsciiWhitespace(line);
      const size_t slash = l.find('/');
      if (slash != absl::string_view::npos) take(l.substr(slash));
    }
    std::fclose(f);
  }
  return out;
}

// Entries of /dev/shm named for `pid`'s private directory.
std::vector<std::string> PrivateDirectoriesOf(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = absl::StrCat("zeroshard-ucx.", pid, ".");
  if (DIR* d = ::opendir(kShmDir); d != nullptr) {
    while (const dirent* e = ::readdir(d)) {
      if (absl::StartsWith(e->d_name, prefix)) out.push_back(absl::StrCat(kShmDir, "/", e->d_name));
    }
    ::closedir(d);
  }
  return out;
}

// transport_test_peer allocating one region over posix shared memory.
class Peer {
 public:
  ~Peer() {
    if (pid_ > 0) Kill();
    if (stdin_ >= 0) ::close(stdin_);
    if (stdout_ >= 0) ::close(stdout_);
  }

  // Starts it with `env` added to this process's environment.
  bool Start(uint64_t bytes, const std::vector<std::string>& env) {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* workspace = std::getenv("TEST_WORKSPACE");
    const std::string binary =
        absl::StrCat(srcdir ? srcdir : ".", "/", workspace ? workspace : "zeroshard",
                     "/transport/transport_test_peer");
    int in[2], out[2];
    if (::pipe(in) != 0 || ::pipe(out) != 0) return false;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, in[1]);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::vector<std::string> args = {binary, "ucx", kTls, std::to_string(bytes), "allocate"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> vars = env;
    for (char** e = environ; *e != nullptr; ++e) vars.emplace_back(*e);
    std::vector<char*> envp;
    for (std::string& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    const int rc =
        ::posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(in[0]);
    ::close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
    if (rc != 0) {
      pid_ = -1;
      ADD_FAILURE() << "spawn " << binary << ": " << std::strerror(rc);
      return false;
    }
    return true;
  }

  // Its first line (the region's address, or "ERROR ..."), or "" when it
  // says nothing until `deadline` or exits first.
  std::string Line(absl::Time deadline) {
    while (output_.find('\n') == std::string::npos) {
      const int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      pollfd p{stdout_, POLLIN, 0};
      if (ms <= 0 || ::poll(&p, 1, ms) <= 0) return "";
      char buffer[4096];
      const ssize_t n = ::read(stdout_, buffer, sizeof(buffer));
      if (n <= 0) return output_;
      output_.append(buffer, static_cast<size_t>(n));
    }
    return output_.substr(0, output_.find('\n'));
  }

  // Whether it has printed its line (without waiting).
  bool Spoke() {
    pollfd p{stdout_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  void Kill() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string output_;
};

// Waits up to 10 s for every one of `files` and `pid`'s private directory to
// be gone; returns what is left.
std::vector<std::string> LeftBehind(const std::set<std::string>& files, pid_t pid) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    std::vector<std::string> left = PrivateDirectoriesOf(pid);
    for (const std::string& f : files) {
      if (Exists(f)) left.push_back(absl::StrCat(f, " (", FileSize(f), " bytes)"));
    }
    if (left.empty() || absl::Now() > deadline) return left;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Removes what a failed expectation found left behind, so that a failing run
// does not keep the memory.
void Remove(const std::set<std::string>& files, pid_t pid) {
  for (const std::string& f : files) ::unlink(f.c_str());
  for (const std::string& d : PrivateDirectoriesOf(pid)) ::rmdir(d.c_str());
}

class UcxShmCleanupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Exists(kShmDir)) GTEST_SKIP() << kShmDir << " does not exist here";
  }
};

// UCX_POSIX_USE_PROC_LINK=n keeps a region's file named for as long as the
// region is mapped (peers open it by name): a killed process must still not
// leave it.
TEST_F(UcxShmCleanupTest, NamedRegionIsGoneAfterSigkill) {
  Peer peer;
  ASSERT_TRUE(peer.Start(4 << 20, {"UCX_POSIX_USE_PROC_LINK=n"}));
  const std::string line = peer.Line(absl::Now() + absl::Seconds(30));
  if (line.empty() || absl::StartsWith(line, "ERROR")) {
    GTEST_SKIP() << "UCX cannot allocate over UCX_TLS=" << kTls << " here: " << line;
  }
  const std::set<std::string> files = ShmFilesOf(peer.pid(), /*live=*/true);
  if (files.empty()) {
    GTEST_SKIP() << "UCX_TLS=" << kTls << " allocated the region without a posix file";
  }
  const pid_t pid = peer.pid();
  peer.Kill();
  const std::vector<std::string> left = LeftBehind(files, pid);
  EXPECT_TRUE(left.empty()) << "left behind by the killed process: " << absl::StrJoin(left, ", ");
  Remove(files, pid);
}

// With the default UCX_POSIX_USE_PROC_LINK=y, UCX names a region's file
// until it has written the whole region into it: killed meanwhile, the
// process must not leave it either.
TEST_F(UcxShmCleanupTest, RegionBeingAllocatedIsGoneAfterSigkill) {
  constexpr uint64_t kBytes = uint64_t{512} << 20;
  Peer peer;
  ASSERT_TRUE(peer.Start(kBytes, {"UCX_POSIX_USE_PROC_LINK=y"}));
  std::set<std::string> files;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  // The region's file: named, and growing while UCX writes it.
  while (absl::Now() < deadline && !peer.Spoke()) {
    for (const std::string& f : ShmFilesOf(peer.pid(), /*live=*/true)) {
      if (FileSize(f) > (16 << 20)) files.insert(f);
    }
    if (!files.empty()) break;
    absl::SleepFor(absl::Microseconds(500));
  }
  if (files.empty()) {
    const std::string line = peer.Line(absl::Now() + absl::Seconds(30));
    GTEST_SKIP() << "never saw the region's file while it was allocated (UCX_TLS=" << kTls
                 << "): " << line;
  }
  files.merge(ShmFilesOf(peer.pid()));
  const pid_t pid = peer.pid();
  peer.Kill();
  const std::vector<std::string> left = LeftBehind(files, pid);
  EXPECT_TRUE(left.empty()) << "left behind by the killed process: " << absl::StrJoin(left, ", ");
  Remove(files, pid);
}

}  // namespace
}  // namespace zeroshard::transport::ucx
