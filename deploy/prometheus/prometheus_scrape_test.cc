// A real Prometheus server on loopback scrapes a daemon with this folder's
// prometheus.yml (targets and intervals rewritten for the test), and its
// HTTP API returns zeroshard_memory_bytes for the job equal to the ledger.

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "metrics/promtool_testutil.h"
#include "server/daemon.h"
#include "common/job_spec.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string FindPrometheus() {
  for (const char* p : {"/usr/bin/prometheus", "/usr/local/bin/prometheus"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// Values of `"category":"<c>"` samples in a /api/v1/query JSON answer.
std::map<std::string, double> CategoryValues(const std::string& json) {
  std::map<std::string, double> out;
  size_t pos = 0;
  while ((pos = json.find("\"category\":\"", pos)) != std::string::npos) {
    pos += 12;
    const std::string category = json.substr(pos, json.find('"', pos) - pos);
    const size_t value = json.find("\"value\":[", pos);
    if (value == std::string::npos) break;
    const size_t quote = json.find('"', json.find(',', value)) + 1;
    double v = 0;
    if (absl::SimpleAtod(json.substr(quote, json.find('"', quote) - quote), &v)) {
      out[category] = v;
    }
    pos = quote;
  }
  return out;
}

TEST(PrometheusScrape, MemoryBytesInPrometheusEqualTheLedger) {
  const std::string prometheus = FindPrometheus();
  if (prometheus.empty()) GTEST_SKIP() << "prometheus is not installed (Debian package prometheus)";

  DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "127.0.0.1:0";
  auto daemon = Daemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  testing::DaemonClient client((*daemon)->address());
  v1::JobSpec spec =
      testing::MakeSpec("prom-job", testing::SampleLayout(), 3, 2, {(*daemon)->address()});
  spec.set_precision(v1::DTYPE_BF16);
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 1).ok());

  // The repository's configuration, pointed at this daemon, scraping every second.
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/prom");
  ASSERT_EQ(system(absl::StrCat("mkdir -p ", dir, "/targets").c_str()), 0);
  const std::string src = "deploy/prometheus/";
  const std::string target = absl::StrCat("127.0.0.1:", (*daemon)->metrics_port());
  std::string config = ReadFile(src + "prometheus.yml");
  ASSERT_NE(config.find("shard-0.example.internal:9464"), std::string::npos);
  config = absl::StrReplaceAll(config, {{"shard-0.example.internal:9464", target},
                                        {"- shard-1.example.internal:9464", ""},
                                        {"scrape_interval: 15s", "scrape_interval: 1s"},
                                        {"scrape_interval: 10s", "scrape_interval: 1s"},
                                        {"scrape_timeout: 5s", "scrape_timeout: 1s"}});
  WriteFile(dir + "/prometheus.yml", config);
  WriteFile(dir + "/alerts.yml", ReadFile(src + "alerts.yml"));
  WriteFile(dir + "/targets/zeroshard.yml", "[]\n");

  const int port = FreePort();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string log = dir + "/prometheus.log";
    freopen(log.c_str(), "w", stdout);
    freopen(log.c_str(), "a", stderr);
    execl(prometheus.c_str(), prometheus.c_str(),
          absl::StrCat("--config.file=", dir, "/prometheus.yml").c_str(),
          absl::StrCat("--storage.tsdb.path=", dir, "/data").c_str(),
          absl::StrCat("--web.listen-address=127.0.0.1:", port).c_str(), nullptr);
    _exit(127);
  }

  const CategoryBytes ledger = (*daemon)->ledger().JobBytes("prom-job");
  std::map<std::string, double> values;
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  bool complete = false;
  while (absl::Now() < deadline && !complete) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto r = metrics::testing::Fetch(
        port, "GET", "/api/v1/query?query=zeroshard_memory_bytes%7Bjob%3D%22prom-job%22%7D");
    if (r.status != 200) continue;
    values = CategoryValues(r.body);
    complete = true;
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      if (ledger[c] > 0 && values.count(MemoryCategoryName(static_cast<MemoryCategory>(c))) == 0) {
        complete = false;
      }
    }
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(complete) << "Prometheus did not report the job's memory within 90 s; log:\n"
                        << ReadFile(dir + "/prometheus.log");
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    const std::string name = MemoryCategoryName(static_cast<MemoryCategory>(c));
    if (ledger[c] == 0) continue;
    EXPECT_EQ(values[name], static_cast<double>(ledger[c])) << name;
  }
  EXPECT_GT(values["param_master"], 0);
  EXPECT_GT(values["param_half"], 0);
}

}  // namespace
}  // namespace zeroshard
