// BulkDataPath against real in-process daemons serving the "inproc" bulk
// transport (no UCX needed).

#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/bulk_data_path.h"
#include "client/rpc.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::kTestIncarnation;
using testing::MakeSpec;
using testing::SampleLayout;

std::unique_ptr<Daemon> StartInproc(const std::string& listen = "127.0.0.1:0") {
  DaemonOptions o;
  o.listen = listen;
  o.bulk_transport = "inproc";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

// One rank, one daemon: register, join, upload, push one step through
// `path`, commit, gather the result through `path`. The push is retried
// (for up to 5 s) while it fails: right after a daemon restart the client's
// channel may still be reconnecting.
absl::StatusOr<std::vector<float>> OneStep(const std::string& address, BulkDataPath& path) {
  const Layout layout = SampleLayout();
  const uint64_t n = layout.total_elements();
  DaemonClient control(address);
  const v1::JobSpec spec = MakeSpec("restart", layout, 2, 1, {address});
  if (grpc::Status s = control.Register(spec, 0); !s.ok()) {
    return absl::InternalError(absl::StrCat("Register: ", s.error_message()));
  }
  if (grpc::Status s = control.Join(spec, 0); !s.ok()) {
    return absl::InternalError(absl::StrCat("Join: ", s.error_message()));
  }
  std::vector<float> params(n, 0.25f), grad(n, 0.5f);
  absl::StatusOr<uint64_t> r = path.InitParameters({"restart", 0, {0, n}, params.data()}, Soon());
  if (!r.ok()) return r.status();
  // Bucket-sized pushes (one staging slot each).
  const uint64_t piece = 1024;
  for (uint64_t b = 0; b < n; b += piece) {
    const FlatRange range{b, std::min(n, b + piece)};
    GradientPush push{"restart", 1, 0, kTestIncarnation, 0, 1, range, DType::kFp32,
                      grad.data() + b};
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    for (;;) {
      r = path.PushGradient(push, Soon());
      if (r.ok() || absl::Now() >= give_up) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    if (!r.ok()) return r.status();
  }
  v1::PrepareStepResponse prep;
  if (grpc::Status s = control.Prepare("restart", 1, &prep); !s.ok()) {
    return absl::InternalError(absl::StrCat("Prepare: ", s.error_message()));
  }
  if (grpc::Status s = control.Commit("restart", 1, 0.1f); !s.ok()) {
    return absl::InternalError(absl::StrCat("Commit: ", s.error_message()));
  }
  std::vector<float> out(n);
  GatherRequestSpec g{"restart", 0, kTestIncarnation, 1, {0, n}, DType::kFp32, absl::Seconds(5)};
  r = path.Gather(g, out.data(), Soon());
  if (!r.ok()) return r.status();
  return out;
}

// Bug 3: the data path used to cache its endpoint forever, so after the
// daemon restarted every Put went to the dead daemon's region and failed.
// Now the failed Put drops the endpoint and the call exchanges again with
// the new daemon: the same step on the restarted daemon (on the same port)
// works and gives the same parameters.
TEST(BulkDataPathDaemonTest, RecoversAfterTheDaemonRestartsOnTheSamePort) {
  std::unique_ptr<Daemon> daemon = StartInproc();
  ASSERT_NE(daemon, nullptr);
  ASSERT_NE(daemon->bulk_transport(), nullptr);
  const std::string address = daemon->address();
  BulkDataPath::Options o;
  o.fence_timeout = absl::Seconds(5);
  BulkDataPath path(address,
                    MakeDaemonChannel(address, ChannelSecurity::Plaintext(testing::kTestToken)),
                    *BulkTransport::Create("inproc", {}), o);
  absl::StatusOr<std::vector<float>> before = OneStep(address, path);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(path.exchanges(), 1u);

  daemon->Shutdown(absl::ZeroDuration());
  daemon.reset();
  daemon = StartInproc(address);
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::vector<float>> after = OneStep(address, path);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(path.exchanges(), 2u);
  ASSERT_EQ(before->size(), after->size());
  EXPECT_EQ(0, std::memcmp(before->data(), after->data(), before->size() * 4));
}

}  // namespace
}  // namespace zeroshard
