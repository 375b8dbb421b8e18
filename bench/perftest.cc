#include "bench/perftest.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

extern char** environ;

namespace zeroshard::bench {
namespace {

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// Starts `args` with UCX_TLS set and stdout to `out_path`; returns its pid or -1.
pid_t Spawn(const std::vector<std::string>& args, const std::string& out_path,
            const std::string& ucx_tls) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("UCX_TLS=", 0) != 0) env_strings.push_back(*e);
  }
  env_strings.push_back("UCX_TLS=" + ucx_tls);
  std::vector<char*> env, argv;
  for (auto& s : env_strings) env.push_back(s.data());
  env.push_back(nullptr);
  std::vector<std::string> copy = args;
  for (auto& s : copy) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

// Waits for `pid` up to `timeout`; kills it past that. Returns its exit code, or -1.
int WaitFor(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (absl::Now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

std::string ReadFile(const std::string& path) {
  std::string s;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    size_t k;
    while ((k = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, k);
    std::fclose(f);
  }
  return s;
}

}  // namespace

double PerftestPutGbps(uint64_t size, const std::string& binary, const std::string& ucx_tls,
                       std::string* why) {
  const uint64_t iters = std::max<uint64_t>(20, (2ull << 30) / size);
  const std::string dir = std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR") : "/tmp";
  const std::string server_out = absl::StrCat(dir, "/zs_perftest_server.", getpid());
  const std::string client_out = absl::StrCat(dir, "/zs_perftest_client.", getpid());
  const std::string& bin = binary;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string port = std::to_string(FreePort());
    const pid_t server = Spawn({bin, "-p", port}, server_out, ucx_tls);
    if (server < 0) {
      *why = bin + " could not be started (not installed?)";
      return NAN;
    }
    absl::SleepFor(absl::Milliseconds(300 * (attempt + 1)));
    const pid_t client = Spawn({bin, "127.0.0.1", "-p", port, "-t", "ucp_put_bw", "-s",
                                std::to_string(size), "-n", std::to_string(iters)},
                               client_out, ucx_tls);
    const int rc = client < 0 ? -1 : WaitFor(client, absl::Seconds(120));
    WaitFor(server, absl::Seconds(rc == 0 ? 10 : 1));
    const std::string out = ReadFile(client_out);
    std::remove(client_out.c_str());
    std::remove(server_out.c_str());
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      if (line.rfind("Final:", 0) != 0) continue;
      std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() >= 7) return std::atof(std::string(f[6]).c_str()) * 1048576.0 / 1e9;
    }
    *why = absl::StrCat(bin, " gave no Final line (exit ", rc, "): ", out.substr(0, 300));
  }
  return NAN;
}

std::vector<double> PerftestPutRuns(uint64_t size, const std::string& binary,
                                    const std::string& ucx_tls, int runs, std::string* why) {
  std::vector<double> out;
  for (int i = 0; i < std::max(1, runs); ++i) {
    const double g = PerftestPutGbps(size, binary, ucx_tls, why);
    if (std::isnan(g)) break;
    out.push_back(g);
  }
  return out;
}

}  // namespace zeroshard::bench
