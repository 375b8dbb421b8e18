#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "tools/zsrun_lib.h"

namespace zeroshard::tools {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string Runfile(absl::string_view path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return absl::StrCat(srcdir ? srcdir : ".", "/zeroshard/", path);
}

std::string TempPath(absl::string_view name) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name, ".", getpid(), ".", ++counter);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// True when Admin.Status on `address` succeeds within a second.
bool Answers(const std::string& address) {
  auto stub = v1::Admin::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::StatusResponse response;
  return stub->Status(&ctx, v1::StatusRequest(), &response).ok();
}

bool Gone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// Runs a Launcher in this process with its output going to files.
struct Launch {
  // Unless `temp_logs`, daemon logs go under TEST_TMPDIR rather than $TMPDIR.
  explicit Launch(LaunchOptions o, bool temp_logs = false)
      : out_path(TempPath("out")), err_path(TempPath("err")) {
    if (o.log_dir.empty() && !temp_logs) o.log_dir = TempPath("logs");
    out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    o.stdout_fd = out_fd;
    o.stderr_fd = err_fd;
    if (o.zeroshardd.empty()) o.zeroshardd = Runfile("server/zeroshardd");
    launcher = std::make_unique<Launcher>(std::move(o));
  }
  ~Launch() {
    close(out_fd);
    close(err_fd);
  }
  absl::StatusOr<int> Run() {
    const absl::Time start = absl::Now();
    absl::StatusOr<int> r = launcher->Run();
    elapsed = absl::Now() - start;
    return r;
  }
  std::string out() const { return ReadFile(out_path); }
  std::string err() const { return ReadFile(err_path); }

  std::string out_path, err_path;
  int out_fd = -1, err_fd = -1;
  std::unique_ptr<Launcher> launcher;
  absl::Duration elapsed;
};

LaunchOptions ShellTrainers(int daemons, int nproc, const std::string& script) {
  LaunchOptions o;
  o.daemons = daemons;
  o.nproc = nproc;
  o.command = {"/bin/sh", "-c", script};
  o.startup_timeout = absl::Seconds(20);
  return o;
}

// The zsrun binary as a child process; stdout and stderr both go to a file.
struct Zsrun {
  explicit Zsrun(const std::vector<std::string>& args) : out_path(TempPath("zsrun")) {
    std::vector<std::string> argv = {Runfile("tools/zsrun")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    start = absl::Now();
    pid = fork();
    if (pid == 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      execv(cargv[0], cargv.data());
      _exit(127);
    }
    close(fd);
  }
  ~Zsrun() {
    if (pid > 0 && code == -1) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  // Exit code, or -1 if it is still running after `timeout`.
  int Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (code == -1 && absl::Now() < deadline) {
      int status;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        code = ExitCodeOf(status);
        elapsed = absl::Now() - start;
      } else {
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    return code;
  }
  // Waits until the output contains `text`.
  bool WaitForOutput(absl::string_view text, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (absl::StrContains(output(), text)) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }
  std::string output() const { return ReadFile(out_path); }

  std::string out_path;
  pid_t pid = -1;
  int code = -1;
  absl::Time start;
  absl::Duration elapsed;
};

// A TCP port that refuses connections: bound, never listening, held open.
struct RefusingPort {
  RefusingPort() {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t len = sizeof addr;
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  ~RefusingPort() { close(fd); }
  int fd;
  int port;
};

// --- Pure helpers ---------------------------------------------------------

std::vector<std::string> Split(LineSplitter& s, const std::vector<std::string>& chunks,
                               bool finish) {
  std::vector<std::string> lines;
  auto sink = [&lines](absl::string_view line) { lines.emplace_back(line); };
  for (const auto& c : chunks) s.Feed(c, sink);
  if (finish) s.Finish(sink);
  return lines;
}

TEST(LineSplitterTest, JoinsPartialWritesIntoWholeLines) {
  LineSplitter s;
  EXPECT_THAT(Split(s, {"ab", "c\nd", "e\n\n"}, false), ElementsAre("abc\n", "de\n", "\n"));
}

TEST(LineSplitterTest, CarriageReturnEndsALineAndIsKept) {
  LineSplitter s;
  // A progress bar: "\r 10%" "\r 20%" then a newline; empty segments vanish.
  EXPECT_THAT(Split(s, {"\r 10%", "\r 20%", "\n"}, false), ElementsAre(" 10%\r", " 20%\n"));
  EXPECT_THAT(Split(s, {"x\r\ny\n"}, false), ElementsAre("x\r\n", "y\n"));
}

TEST(LineSplitterTest, TrailingCarriageReturnWaitsForAPossibleNewline) {
  LineSplitter s;
  EXPECT_THAT(Split(s, {"done\r"}, false), IsEmpty());
  EXPECT_THAT(Split(s, {"\nnext\r"}, false), ElementsAre("done\r\n"));
  EXPECT_THAT(Split(s, {"more"}, false), ElementsAre("next\r"));
}

TEST(LineSplitterTest, FinishEndsAPartialLine) {
  LineSplitter s;
  EXPECT_THAT(Split(s, {"no newline"}, true), ElementsAre("no newline\n"));
  EXPECT_THAT(Split(s, {"bar\r"}, true), ElementsAre("bar\r\n"));
  EXPECT_THAT(Split(s, {"\r"}, true), IsEmpty());
}

TEST(LineSplitterTest, CutsOverlongLines) {
  LineSplitter s;
  const std::vector<std::string> lines = Split(s, {std::string(70000, 'x')}, false);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].size(), 70001u);
  EXPECT_EQ(lines[0].back(), '\n');
}

TEST(ParseAddressListTest, AcceptsHostPortList) {
  auto a = ParseAddressList(" 127.0.0.1:7070, node2:7071,,[::1]:9 ");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(*a, ElementsAre("127.0.0.1:7070", "node2:7071", "[::1]:9"));
}

TEST(ParseAddressListTest, RejectsEntriesWithoutAPort) {
  for (const char* bad : {"localhost", "host:", ":80", "host:http", "host:70000"}) {
    EXPECT_EQ(ParseAddressList(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(TrainerEnvironmentTest, SetsTheRankVariablesAndReplacesOldOnes) {
  TrainerEnv te;
  te.rank = 2;
  te.world_size = 4;
  te.daemons = {"127.0.0.1:1", "127.0.0.1:2"};
  te.job_id = "j";
  te.job_token = "t0123456789abcdef";
  const std::vector<std::string> env =
      TrainerEnvironment({"PATH=/bin", "RANK=9", "ZS_METRICS_PORTS=5", "ZS_JOB_TOKEN=old"}, te);
  EXPECT_THAT(env, ElementsAre("PATH=/bin", "ZS_RANK=2", "ZS_WORLD_SIZE=4",
                               "ZS_DAEMONS=127.0.0.1:1,127.0.0.1:2", "ZS_JOB_ID=j",
                               "ZS_JOB_TOKEN=t0123456789abcdef", "ZS_REGISTRATION_TOKEN=",
                               "RANK=2", "WORLD_SIZE=4",
                               "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=4", "ZS_RESTART_COUNT=0"));
  te.metrics_ports = {81, 82};
  EXPECT_EQ(TrainerEnvironment({}, te).back(), "ZS_METRICS_PORTS=81,82");
  te.master_port = 29500;
  te.collective_dir = "/run/zs/collective";
  EXPECT_THAT(TrainerEnvironment({"MASTER_PORT=1"}, te),
              ::testing::IsSupersetOf({"MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500",
                                       "ZS_COLLECTIVE_DIR=/run/zs/collective"}));
  EXPECT_THAT(TrainerEnvironment({"MASTER_PORT=1"}, te), ::testing::Not(::testing::Contains(
                                                             "MASTER_PORT=1")));
  // No daemons of zsrun's: the launcher's own data path variables stay.
  EXPECT_THAT(TrainerEnvironment({"ZS_TRANSPORT=grpc"}, te), ::testing::Contains("ZS_TRANSPORT=grpc"));
  te.transport = "ucx";
  te.ucx_tls = "posix,cma,self";
  const std::vector<std::string> with_transport =
      TrainerEnvironment({"ZS_TRANSPORT=grpc", "ZS_UCX_TLS=tcp"}, te);
  EXPECT_THAT(with_transport, ::testing::IsSupersetOf({"ZS_TRANSPORT=ucx",
                                                       "ZS_UCX_TLS=posix,cma,self"}));
  EXPECT_THAT(with_transport, ::testing::Not(::testing::Contains("ZS_TRANSPORT=grpc")));
  EXPECT_THAT(with_transport, ::testing::Not(::testing::Contains("ZS_UCX_TLS=tcp")));
}

TEST(WithNonTemporalThresholdTest, AddsTheTunableUnlessTheCallerSetIt) {
  constexpr char kSet[] = "GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=4194304";
  EXPECT_THAT(WithNonTemporalThreshold({"PATH=/bin"}, 4 << 20), ElementsAre("PATH=/bin", kSet));
  EXPECT_THAT(WithNonTemporalThreshold({"GLIBC_TUNABLES="}, 4 << 20), ElementsAre(kSet));
  EXPECT_THAT(
      WithNonTemporalThreshold({"GLIBC_TUNABLES=glibc.malloc.arena_max=2", "A=1"}, 4 << 20),
      ElementsAre("GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold="
                  "4194304",
                  "A=1"));
  const std::vector<std::string> mine = {
      "GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold=1024"};
  EXPECT_EQ(WithNonTemporalThreshold(mine, 4 << 20), mine);
  EXPECT_THAT(WithNonTemporalThreshold({"PATH=/bin"}, 0), ElementsAre("PATH=/bin"));
}

TEST(FindZeroshardTest, SearchOrder) {
  EXPECT_THAT(ZeroshardddCandidates("/b/tools/zsrun", "/r", "/usr/bin::/bin"),
              ElementsAre("/b/tools/../server/zeroshardd",
                          "/b/tools/zsrun.runfiles/zeroshard/server/zeroshardd",
                          "/r/zeroshard/server/zeroshardd", "/b/tools/zeroshardd",
                          "/usr/bin/zeroshardd", "/bin/zeroshardd"));
}

TEST(FindZeroshardTest, FlagMustNameAnExecutable) {
  EXPECT_EQ(FindZeroshardd("/nonexistent/zeroshardd").status().code(), absl::StatusCode::kNotFound);
  auto found = FindZeroshardd(Runfile("server/zeroshardd"));
  ASSERT_TRUE(found.ok()) << found.status();
  // Without the flag the test binary's own bazel-bin neighbourhood has one.
  EXPECT_TRUE(FindZeroshardd("").ok());
}

TEST(ExitCodeTest, SignalsMapTo128Plus) {
  EXPECT_EQ(ExitCodeOf(3 << 8), 3);
  EXPECT_EQ(ExitCodeOf(SIGKILL), 128 + SIGKILL);
}

// --- Launcher in process ----------------------------------------------------

TEST(LauncherTest, TwoDaemonsThreeTrainersSeeTheirEnvironment) {
  Launch l(ShellTrainers(2, 3,
                         "echo rank=$ZS_RANK world=$ZS_WORLD_SIZE daemons=$ZS_DAEMONS; "
                         "echo master=$MASTER_ADDR:$MASTER_PORT collective=$ZS_COLLECTIVE_DIR >&2; "
                         "echo registration=${#ZS_REGISTRATION_TOKEN} >&2; "
                         "echo oops >&2"),
           /*temp_logs=*/true);
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status() << l.err();
  EXPECT_EQ(*code, 0) << l.err();

  const std::vector<std::string> lines = Lines(l.out());
  ASSERT_EQ(lines.size(), 3u) << l.out();
  std::set<std::string> daemon_lists;
  std::set<int> ranks;
  for (const std::string& line : lines) {
    int rank = -1;
    ASSERT_EQ(std::sscanf(line.c_str(), "[rank %d] rank=", &rank), 1) << line;
    ranks.insert(rank);
    EXPECT_TRUE(absl::StartsWith(line, absl::StrCat("[rank ", rank, "] rank=", rank, " world=3 ")))
        << line;
    daemon_lists.insert(line.substr(line.find("daemons=") + 8));
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  ASSERT_EQ(daemon_lists.size(), 1u);  // Every rank sees the same list.
  const std::vector<std::string> daemons = absl::StrSplit(*daemon_lists.begin(), ',');
  ASSERT_EQ(daemons.size(), 2u);
  EXPECT_NE(daemons[0], daemons[1]);
  EXPECT_EQ(daemons, l.launcher->addresses());
  for (const std::string& d : daemons) EXPECT_TRUE(absl::StartsWith(d, "127.0.0.1:")) << d;
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(l.err(), HasSubstr(absl::StrCat("[rank ", r, "] oops\n")));
  }
  // What torch.distributed's env:// and the trainer collective rendezvous
  // on: one port and one directory for every rank.
  std::set<std::string> rendezvous;
  for (const std::string& line : Lines(l.err())) {
    if (line.find("] master=") != std::string::npos) {
      rendezvous.insert(line.substr(line.find("master=")));
    }
  }
  ASSERT_EQ(rendezvous.size(), 1u) << l.err();
  // The daemons' registration token (64 hex digits), for every rank.
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(l.err(), HasSubstr(absl::StrCat("[rank ", r, "] registration=64\n")));
  }
  EXPECT_THAT(*rendezvous.begin(), ::testing::MatchesRegex(
                                       "master=127\\.0\\.0\\.1:[1-9][0-9]* collective=.*/collective"));

  // Afterwards the daemons are stopped and reaped, and the temp log dir gone.
  for (pid_t pid : l.launcher->daemon_pids()) EXPECT_TRUE(Gone(pid)) << pid;
  for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
  for (const std::string& d : daemons) EXPECT_FALSE(Answers(d)) << d;
  EXPECT_FALSE(l.launcher->log_dir().empty());
  EXPECT_FALSE(Exists(l.launcher->log_dir()));
}

TEST(LauncherTest, FailingTrainerStopsTheOthersAndSetsTheExitCode) {
  LaunchOptions o =
      ShellTrainers(1, 3, "if [ $ZS_RANK = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 60");
  // A long grace period: had SIGTERM not ended the sleepers, the run would
  // last it out (a loaded machine takes seconds to start the daemon).
  o.grace = absl::Seconds(30);
  Launch l(std::move(o));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 3) << l.err();
  EXPECT_LT(l.elapsed, absl::Seconds(20));  // The sleepers died of SIGTERM.
  EXPECT_THAT(l.err(), HasSubstr("rank 1 exited with code 3"));
  for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
  for (pid_t pid : l.launcher->daemon_pids()) EXPECT_TRUE(Gone(pid)) << pid;
}

// torch.distributed.init_process_group() with no arguments (env://) works
// under zsrun as under torchrun: the ranks meet at MASTER_ADDR:MASTER_PORT
// and all-reduce.
TEST(LauncherTest, TorchDistributedInitializesWithoutArguments) {
  if (std::system("python3 -c 'import torch.distributed' 2>/dev/null") != 0) {
    GTEST_SKIP() << "python3 with torch is not installed";
  }
  Launch l(ShellTrainers(1, 2,
                         "exec python3 -c 'import torch, torch.distributed as d; "
                         "d.init_process_group(\"gloo\"); t = torch.ones(1) * (d.get_rank() + 1); "
                         "d.all_reduce(t); print(\"sum\", int(t.item()), d.get_world_size())'"));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << l.err();
  EXPECT_THAT(l.out(), HasSubstr("[rank 0] sum 3 2"));
  EXPECT_THAT(l.out(), HasSubstr("[rank 1] sum 3 2"));
}

// --peak_rss: each process's peak resident set, as wait4 reported it. A
// trainer that touches 64 MiB shows at least that; the daemon its own.
TEST(LauncherTest, PeakRssOfEveryProcess) {
  LaunchOptions o = ShellTrainers(1, 2,
                                  "if [ $ZS_RANK = 1 ]; then exec python3 -c "
                                  "'b = bytearray(64 << 20); b[::4096] = b\"x\" * (16 << 10)'; fi");
  o.peak_rss = true;
  Launch l(std::move(o));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << l.err();
  for (const char* who : {"rank 0", "rank 1", "daemon 0"}) {
    const std::string err = l.err();
    const size_t at = err.find(absl::StrCat("[zsrun] ", who, " (pid "));
    ASSERT_NE(at, std::string::npos) << who << ": " << err;
    const size_t open = err.find("peak RSS ", at);
    const size_t bytes_at = err.find(" (", open) + 2;
    uint64_t bytes = 0;
    ASSERT_TRUE(
        absl::SimpleAtoi(err.substr(bytes_at, err.find(" B)", bytes_at) - bytes_at), &bytes))
        << err.substr(at, 120);
    EXPECT_GT(bytes, 0u) << who;
    if (std::string(who) == "rank 1") EXPECT_GE(bytes, uint64_t{64} << 20) << err.substr(at, 120);
  }
}

// --max_restarts: a failed rank is started again with ZS_RESTART_COUNT one
// higher while the others keep running; a failure past the budget stops the
// run as without it.
TEST(LauncherTest, MaxRestartsRestartsTheFailedRankOnly) {
  const std::string marks = TempPath("marks");
  ASSERT_EQ(mkdir(marks.c_str(), 0755), 0);
  // Rank 1 dies of SIGKILL on its first run and exits 5 on its second; rank
  // 0 records each start and exits 0 once rank 1 has run three times.
  const std::string script =
      absl::StrCat("echo start >> ", marks,
                   "/rank$ZS_RANK; "
                   "if [ $ZS_RANK = 1 ]; then "
                   "  case $ZS_RESTART_COUNT in 0) kill -9 $$;; 1) exit 5;; esac; exit 0; "
                   "fi; "
                   "while [ $(wc -l < ",
                   marks, "/rank1 2>/dev/null || echo 0) -lt 3 ]; do sleep 0.05; done");
  {
    LaunchOptions o = ShellTrainers(1, 2, script);
    o.max_restarts = 2;
    Launch l(std::move(o));
    absl::StatusOr<int> code = l.Run();
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << l.err();
    EXPECT_THAT(l.err(), HasSubstr("rank 1 exited with code 137; restarting it (restart 1 of 2)"));
    EXPECT_THAT(l.err(), HasSubstr("rank 1 exited with code 5; restarting it (restart 2 of 2)"));
    EXPECT_EQ(Lines(ReadFile(marks + "/rank0")).size(), 1u);  // never restarted
    EXPECT_EQ(Lines(ReadFile(marks + "/rank1")).size(), 3u);
    EXPECT_EQ(l.launcher->trainer_pids().size(), 4u);
    for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
  }
  // One restart fewer: the second failure ends the run with its code.
  std::remove((marks + "/rank0").c_str());
  std::remove((marks + "/rank1").c_str());
  LaunchOptions o = ShellTrainers(1, 2, script);
  o.max_restarts = 1;
  o.grace = absl::Seconds(5);
  Launch l(std::move(o));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 5) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("rank 1 exited with code 5; stopping the other trainers"));
  for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
}

TEST(LauncherTest, TrainerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  // `trap "" TERM` is inherited by the exec'ed sleep.
  LaunchOptions o = ShellTrainers(
      1, 2, "if [ $ZS_RANK = 1 ]; then sleep 0.3; exit 5; fi; trap '' TERM; exec sleep 60");
  o.grace = absl::Seconds(1);
  Launch l(std::move(o));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 5) << l.err();
  EXPECT_GE(l.elapsed, absl::Seconds(1));
  EXPECT_LT(l.elapsed, absl::Seconds(40));  // Killed, not waited for (sleep 60).
  for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
}

TEST(LauncherTest, TrainersReachTheDaemonsWithZsctl) {
  Launch l(ShellTrainers(2, 2,
                         absl::StrCat("'", Runfile("tools/zsctl"),
                                      "' status --daemons=\"$ZS_DAEMONS\" --timeout_ms=5000")));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << l.out() << l.err();
  for (int r = 0; r < 2; ++r) {
    for (const std::string& d : l.launcher->addresses()) {
      EXPECT_THAT(l.out(), HasSubstr(absl::StrCat("[rank ", r, "] daemon ", d, "  version")));
    }
  }
}

TEST(LauncherTest, InterruptIsForwardedToTrainers) {
  Launch l(ShellTrainers(1, 2, "echo ready; exec sleep 60"));
  std::thread interrupter([&l] {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline && Lines(l.out()).size() < 2) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    l.launcher->Interrupt(SIGTERM);
  });
  absl::StatusOr<int> code = l.Run();
  interrupter.join();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGTERM) << l.err();
  EXPECT_LT(l.elapsed, absl::Seconds(40));  // Not the trainers' sleep 60.
  for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
  for (pid_t pid : l.launcher->daemon_pids()) EXPECT_TRUE(Gone(pid)) << pid;
}

TEST(LauncherTest, DaemonDeathStopsTheTrainers) {
  Launch l(ShellTrainers(2, 2, "echo ready; exec sleep 60"));
  std::thread killer([&l] {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline && Lines(l.out()).size() < 2) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    // The trainers are running, so the daemon list no longer changes.
    kill(l.launcher->daemon_pids()[1], SIGKILL);
  });
  absl::StatusOr<int> code = l.Run();
  killer.join();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("daemon 1 exited with code 137; stopping the trainers"));
  EXPECT_LT(l.elapsed, absl::Seconds(40));  // Not the trainers' sleep 60.
  for (pid_t pid : l.launcher->trainer_pids()) EXPECT_TRUE(Gone(pid)) << pid;
  for (pid_t pid : l.launcher->daemon_pids()) EXPECT_TRUE(Gone(pid)) << pid;
}

TEST(LauncherTest, DaemonThatCannotStartShowsItsStderr) {
  LaunchOptions o = ShellTrainers(1, 1, "true");
  o.daemon_args = {"--no_such_flag"};
  Launch l(std::move(o));
  absl::StatusOr<int> code = l.Run();
  EXPECT_EQ(code.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(code.status().message(), HasSubstr("daemon 0"));
  EXPECT_THAT(l.err(), HasSubstr("[daemon 0] "));
  EXPECT_THAT(l.err(), HasSubstr("no_such_flag"));
  EXPECT_LT(l.elapsed, absl::Seconds(18));  // Before the 20 s startup timeout.
  EXPECT_TRUE(Exists(l.launcher->log_dir()));  // Kept after a failure.
}

TEST(LauncherTest, LogDirMetricsAndVerbose) {
  LaunchOptions o = ShellTrainers(1, 1, "echo ports=$ZS_METRICS_PORTS job=$ZS_JOB_ID");
  o.log_dir = TempPath("logs") + "/nested";
  o.metrics = true;
  o.verbose = true;
  o.job_id = "my-job";
  const std::string dir = o.log_dir;
  Launch l(std::move(o));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << l.err();
  int port = 0;
  ASSERT_EQ(std::sscanf(l.out().c_str(), "[rank 0] ports=%d job=my-job", &port), 1) << l.out();
  EXPECT_GT(port, 0);
  EXPECT_THAT(ReadFile(dir + "/daemon-0.stdout.log"),
              HasSubstr(absl::StrCat("zeroshardd listening on ", l.launcher->addresses()[0])));
  EXPECT_THAT(ReadFile(dir + "/daemon-0.stderr.log"), HasSubstr("zeroshardd: stopped"));
  // Logs may hold tokens: nobody but the owner reads them.
  for (const std::string& path :
       {dir, dir + "/daemon-0.stdout.log", dir + "/daemon-0.stderr.log"}) {
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 077, 0u) << path << std::oct << " mode " << (st.st_mode & 0777);
  }
  EXPECT_THAT(l.err(), HasSubstr("[daemon 0] zeroshardd: stopped"));
  EXPECT_THAT(l.err(), HasSubstr("daemon logs are in " + dir));
}

TEST(LauncherTest, RejectsBadOptions) {
  LaunchOptions o;
  Launch no_command(o);
  EXPECT_EQ(no_command.Run().status().code(), absl::StatusCode::kInvalidArgument);
  o = ShellTrainers(1, 1, "true");
  o.command = {"no-such-trainer-command"};
  Launch missing(o);
  EXPECT_EQ(missing.Run().status().code(), absl::StatusCode::kNotFound);
  o = ShellTrainers(1, 1, "true");
  o.max_restarts = -1;
  Launch negative(o);
  EXPECT_EQ(negative.Run().status().code(), absl::StatusCode::kInvalidArgument);
  o = ShellTrainers(1, 1, "true");
  o.nt_copy_threshold = 4096;
  Launch too_small(o);
  const absl::Status s = too_small.Run().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--nt_copy_threshold=4096"));
}

TEST(LauncherTest, TrainersGetTheNonTemporalCopyThreshold) {
  Launch l(ShellTrainers(1, 1, "echo \"tunables=$GLIBC_TUNABLES\""));
  absl::StatusOr<int> code = l.Run();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_THAT(l.out(), HasSubstr("[rank 0] tunables=glibc.cpu.x86_non_temporal_threshold=4194304"));
}

// The data path zeroshard.torch's init_from_env takes: the bulk transport
// every daemon serves (ucx with its UCX_TLS, or grpc), else the streaming
// RPCs.
TEST(LauncherTest, TrainersGetTheDaemonsDataPath) {
  struct Case {
    std::vector<std::string> daemon_args;
    std::string expected;  // empty: as the daemons' logs say
  };
  const Case cases[] = {
      {{"--bulk_transport=grpc"}, "transport=grpc tls="},
      {{"--bulk_transport="}, "transport=stream tls="},
      {{}, ""},  // zeroshardd's default: UCX where it starts here
  };
  for (const Case& c : cases) {
    LaunchOptions o = ShellTrainers(2, 1, "echo \"transport=$ZS_TRANSPORT tls=$ZS_UCX_TLS\"");
    o.daemon_args = c.daemon_args;
    Launch l(o);
    absl::StatusOr<int> code = l.Run();
    ASSERT_TRUE(code.ok()) << code.status() << l.err();
    EXPECT_EQ(*code, 0) << l.err();
    std::string expected = c.expected;
    if (expected.empty()) {
      bool ucx = true;
      for (int d = 0; d < 2; ++d) {
        const std::string log =
            ReadFile(absl::StrCat(l.launcher->log_dir(), "/daemon-", d, ".stdout.log"));
        ucx = ucx && log.find("zeroshardd bulk transport ucx ucx_tls=posix,cma,self\n") !=
                         std::string::npos;
      }
      expected = ucx ? "transport=ucx tls=posix,cma,self" : "transport=stream tls=";
    }
    EXPECT_THAT(Lines(l.out()), ElementsAre(absl::StrCat("[rank 0] ", expected)))
        << (c.daemon_args.empty() ? "" : c.daemon_args[0]);
  }
}

// --- The zsrun binary ---------------------------------------------------------

TEST(ZsrunBinaryTest, RunsTrainersAndStopsTheDaemons) {
  Zsrun z({"--daemons=2", "--nproc=3", "--", "/bin/sh", "-c",
           "echo rank=$ZS_RANK world=$ZS_WORLD_SIZE daemons=$ZS_DAEMONS"});
  ASSERT_EQ(z.Wait(absl::Seconds(30)), 0) << z.output();
  const std::string out = z.output();
  std::string daemons;
  for (int r = 0; r < 3; ++r) {
    const std::string prefix = absl::StrCat("[rank ", r, "] rank=", r, " world=3 daemons=");
    const size_t at = out.find(prefix);
    ASSERT_NE(at, std::string::npos) << out;
    daemons = out.substr(at + prefix.size(), out.find('\n', at) - at - prefix.size());
  }
  const std::vector<std::string> list = absl::StrSplit(daemons, ',');
  ASSERT_EQ(list.size(), 2u) << daemons;
  EXPECT_NE(list[0], list[1]);
  for (const std::string& d : list) {
    EXPECT_TRUE(absl::StartsWith(d, "127.0.0.1:")) << d;
    EXPECT_FALSE(Answers(d)) << d;
  }
}

TEST(ZsrunBinaryTest, UnreachableDaemonAddressFailsWithinTheStartupTimeout) {
  RefusingPort refusing;
  const std::string address = absl::StrCat("127.0.0.1:", refusing.port);
  Zsrun z({"--daemon_addresses=" + address, "--startup_timeout_s=2", "--", "/bin/true"});
  EXPECT_EQ(z.Wait(absl::Seconds(15)), 1) << z.output();
  EXPECT_LT(z.elapsed, absl::Seconds(6));
  EXPECT_THAT(z.output(), HasSubstr(absl::StrCat("zsrun: daemon ", address,
                                                 " did not answer its health check within 2s")));
}

TEST(ZsrunBinaryTest, PrintDaemonsHoldsThemUntilSigint) {
  Zsrun z({"--daemons=2", "--print_daemons"});
  ASSERT_TRUE(z.WaitForOutput("SIGINT or SIGTERM stops them", absl::Seconds(20))) << z.output();
  const std::string out = z.output();
  const size_t at = out.find("ZS_DAEMONS=");
  ASSERT_NE(at, std::string::npos) << out;
  const std::vector<std::string> list =
      absl::StrSplit(out.substr(at + 11, out.find('\n', at) - at - 11), ',');
  ASSERT_EQ(list.size(), 2u) << out;
  for (const std::string& d : list) EXPECT_TRUE(Answers(d)) << d;
  // The data path for trainers started elsewhere: zeroshardd's default.
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("\nZS_TRANSPORT=ucx\nZS_UCX_TLS=posix,cma,self\n"),
                                    HasSubstr("\nZS_TRANSPORT=stream\n")))
      << out;
  kill(z.pid, SIGINT);
  EXPECT_EQ(z.Wait(absl::Seconds(15)), 0) << z.output();
  for (const std::string& d : list) EXPECT_FALSE(Answers(d)) << d;
}

TEST(ZsrunBinaryTest, DrainingDaemonIsRefusedByItsHealthCheck) {
  // A daemon with an admin token, held by one zsrun, drained; a second
  // zsrun given its address finds it NOT_SERVING and starts no trainer.
  const std::string token_file = absl::StrCat(std::getenv("TEST_TMPDIR"), "/admin.token");
  const std::string token = "zsrun-test-admin-token-0123456789";
  {
    std::FILE* f = std::fopen(token_file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(token.c_str(), f);
    std::fclose(f);
    ASSERT_EQ(chmod(token_file.c_str(), 0600), 0);
  }
  Zsrun holder(
      {"--daemons=1", "--print_daemons", "--daemon_args=--admin_token_file=" + token_file});
  ASSERT_TRUE(holder.WaitForOutput("SIGINT or SIGTERM stops them", absl::Seconds(20)))
      << holder.output();
  const std::string out = holder.output();
  const size_t at = out.find("ZS_DAEMONS=");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string address = out.substr(at + 11, out.find('\n', at) - at - 11);
  {
    auto stub =
        v1::Control::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::DrainResponse response;
    const grpc::Status s = stub->Drain(&ctx, v1::DrainRequest(), &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  Zsrun z({"--daemon_addresses=" + address, "--startup_timeout_s=5", "--", "/bin/true"});
  EXPECT_EQ(z.Wait(absl::Seconds(15)), 1) << z.output();
  EXPECT_THAT(z.output(), HasSubstr(absl::StrCat("zsrun: daemon ", address,
                                                 " is not serving (health: NOT_SERVING")));
  kill(holder.pid, SIGINT);
  EXPECT_EQ(holder.Wait(absl::Seconds(15)), 0) << holder.output();
}

TEST(ZsrunBinaryTest, UsageErrorsExit2) {
  Zsrun z({"--nproc=0", "--", "/bin/true"});
  EXPECT_EQ(z.Wait(absl::Seconds(15)), 2) << z.output();
  Zsrun bad({"--daemon_addresses=nohost", "--", "/bin/true"});
  EXPECT_EQ(bad.Wait(absl::Seconds(15)), 2) << bad.output();
}

}  // namespace
}  // namespace zeroshard::tools
