#include "metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/promtool_testutil.h"
#include "metrics/registry.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace zeroshard::metrics {
namespace {

using ::prometheus::TextSerializer;
using ::testing::HasSubstr;
using testing::Fetch;
using testing::HttpResponse;

// A registry filled like a daemon's, with awkward label values.
class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto& memory = Register<kMemoryBytes>(registry_);
    for (absl::string_view category : kMemoryCategories) {
      memory
          .Add({{"job", "gpt \"small\"\\run\n2"},
                {"category", std::string(category)}})
          .Set(1 << 20);
    }
    Register<kCommBytesTotal>(registry_)
        .Add({{"job", "a"}, {"op", "push"}, {"transport", "ucx"}})
        .Increment(123456789);
    auto& step = Register<kStepSeconds>(registry_);
    for (double v : {0.002, 0.3, 7.0, 500.0})
      step.Add({{"job", "a"}}, LatencySecondsBuckets()).Observe(v);
    Register<kBuildInfo>(registry_).Add({{"version", "0.1.0"}}).Set(1);
  }

  prometheus::Registry registry_;
};

TEST_F(MetricsHttpServerTest, ServesMetricsThatPromtoolAccepts) {
  MetricsHttpServer server(registry_, "127.0.0.1:0");
  ASSERT_TRUE(server.Start().ok());
  ASSERT_GT(server.port(), 0);

  const HttpResponse response = Fetch(server.port(), "GET", "/metrics");
  ASSERT_EQ(response.status, 200) << response.headers;
  EXPECT_THAT(
      response.headers,
      HasSubstr("Content-Type: text/plain; version=0.0.4; charset=utf-8"));
  EXPECT_EQ(response.body, TextSerializer().Serialize(registry_.Collect()));
  EXPECT_THAT(
      response.body,
      HasSubstr("zeroshard_step_seconds_bucket{job=\"a\",le=\"+Inf\"} 4"));

  const std::string promtool = testing::FindPromtool();
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not found on PATH or in /usr/bin; install the "
                    "prometheus package to run the exposition lint";
  }
  const testing::CommandResult lint =
      testing::RunPromtool(promtool, "check metrics", response.body);
  EXPECT_EQ(lint.exit_code, 0) << lint.output;
  EXPECT_EQ(lint.output, "") << response.body;
}

TEST_F(MetricsHttpServerTest, HeadHasHeadersOnly) {
  MetricsHttpServer server(registry_, "127.0.0.1:0");
  ASSERT_TRUE(server.Start().ok());
  const HttpResponse response = Fetch(server.port(), "HEAD", "/metrics");
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.body, "");
}

TEST_F(MetricsHttpServerTest, OtherPathsAndMethods) {
  MetricsHttpServer server(registry_, "127.0.0.1:0");
  ASSERT_TRUE(server.Start().ok());
  EXPECT_EQ(Fetch(server.port(), "GET", "/").status, 404);
  EXPECT_EQ(Fetch(server.port(), "GET", "/metrics/x").status, 404);
  EXPECT_EQ(Fetch(server.port(), "GET", "/metricsx").status, 404);
  const HttpResponse post = Fetch(server.port(), "POST", "/metrics");
  EXPECT_EQ(post.status, 405);
  EXPECT_THAT(post.headers, HasSubstr("Allow: GET, HEAD"));
  // Still serving after the errors.
  EXPECT_EQ(Fetch(server.port(), "GET", "/metrics?x=1").status, 200);
}

TEST_F(MetricsHttpServerTest, ServesThePageAtRootWhenGivenOne) {
  int renders = 0;
  MetricsHttpServer server(registry_, "127.0.0.1:0", [&renders] {
    ++renders;  // Requests are sequential here.
    return std::string("<!DOCTYPE html><p>caf\u00e9</p>");
  });
  ASSERT_TRUE(server.Start().ok());
  const HttpResponse page = Fetch(server.port(), "GET", "/");
  ASSERT_EQ(page.status, 200) << page.headers;
  EXPECT_EQ(page.body, "<!DOCTYPE html><p>caf\u00e9</p>");
  EXPECT_THAT(page.headers,
              HasSubstr("Content-Type: text/html; charset=utf-8"));
  EXPECT_THAT(page.headers,
              HasSubstr("Content-Security-Policy: default-src 'none'; "
                        "style-src 'unsafe-inline'"));
  EXPECT_THAT(page.headers, HasSubstr("X-Content-Type-Options: nosniff"));
  EXPECT_THAT(page.headers, HasSubstr("Cache-Control: no-store"));
  EXPECT_THAT(page.headers,
              HasSubstr(absl::StrCat("Content-Length: ", page.body.size())));

  const HttpResponse head = Fetch(server.port(), "HEAD", "/");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");
  const HttpResponse post = Fetch(server.port(), "POST", "/");
  EXPECT_EQ(post.status, 405);
  EXPECT_THAT(post.headers, HasSubstr("Allow: GET, HEAD"));
  EXPECT_EQ(Fetch(server.port(), "GET", "/index.html").status, 404);
  EXPECT_EQ(renders, 2);  // GET and HEAD.

  // /metrics is unchanged.
  const HttpResponse metrics = Fetch(server.port(), "GET", "/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_EQ(metrics.body, TextSerializer().Serialize(registry_.Collect()));
}

// Clients that connect and send nothing hold a worker each until the
// request timeout: a scrape is served while a few of them are held, and the
// daemon closes them after the timeout.
TEST_F(MetricsHttpServerTest, SlowClientsDoNotStallScrapes) {
  MetricsHttpServer server(registry_, "127.0.0.1:0");
  ASSERT_TRUE(server.Start().ok());
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    idle.push_back(fd);
  }
  EXPECT_EQ(Fetch(server.port(), "GET", "/metrics").status, 200);
  // Served while every idle connection was still held open by the server
  // (a connection it closed would read as end of file at once).
  for (int fd : idle) {
    pollfd p = {fd, POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 0), 0) << "the server dropped an idle connection before the scrape";
  }
  // ... and it closes them once they stalled past the request timeout.
  for (int fd : idle) {
    pollfd p = {fd, POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 10000), 1) << "an idle connection was kept past the timeout";
    char byte;
    EXPECT_LE(read(fd, &byte, 1), 0);
    close(fd);
  }
}

TEST_F(MetricsHttpServerTest, PortInUseIsAClearError) {
  MetricsHttpServer first(registry_, "127.0.0.1:0");
  ASSERT_TRUE(first.Start().ok());
  const std::string address = absl::StrCat("127.0.0.1:", first.port());
  MetricsHttpServer second(registry_, address);
  const absl::Status status = second.Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr(address));
  EXPECT_THAT(status.message(), HasSubstr("Address already in use"));
  EXPECT_EQ(second.port(), 0);
  // The first one is unaffected.
  EXPECT_EQ(Fetch(first.port(), "GET", "/metrics").status, 200);
}

TEST_F(MetricsHttpServerTest, MalformedAddresses) {
  for (const char* bad :
       {"", "9464", "127.0.0.1", "127.0.0.1:", "127.0.0.1:x", "127.0.0.1:65536",
        "127.0.0.1:-1", "example.com:80", "1.2.3:80", "[::1:80", "[zz]:80"}) {
    MetricsHttpServer server(registry_, bad);
    EXPECT_EQ(server.Start().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(MetricsHttpServerTest, StartStopRestart) {
  MetricsHttpServer server(registry_, "localhost:0");
  ASSERT_TRUE(server.Start().ok());
  EXPECT_EQ(server.Start().code(), absl::StatusCode::kFailedPrecondition);
  server.Stop();
  EXPECT_EQ(server.port(), 0);
  server.Stop();  // Idempotent.
  ASSERT_TRUE(server.Start().ok());
  EXPECT_EQ(Fetch(server.port(), "GET", "/metrics").status, 200);
}

}  // namespace
}  // namespace zeroshard::metrics
