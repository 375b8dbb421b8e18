#include "server/testing/request_sequence.h"

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard::testing {
namespace {

TEST(RequestSequenceTest, SeedsSurviveEncoding) {
  for (const auto& [name, calls] : SeedSequences()) {
    const std::vector<Call> decoded = DecodeSequence(EncodeSequence(calls));
    ASSERT_EQ(decoded.size(), calls.size()) << name;
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(decoded[i].rpc, calls[i].rpc) << name << " call " << i;
      EXPECT_EQ(decoded[i].fixups, calls[i].fixups) << name << " call " << i;
      EXPECT_EQ(decoded[i].messages, calls[i].messages) << name << " call " << i;
    }
  }
}

TEST(RequestSequenceTest, SeedsFitTheFuzzersInputLimit) {
  for (const auto& [name, calls] : SeedSequences()) {
    EXPECT_LE(EncodeSequence(calls).size(), 65536u) << name;  // tools/fuzz.sh -max_len
  }
}

TEST(RequestSequenceTest, DecodingTakesAnyBytes) {
  EXPECT_TRUE(DecodeSequence("").empty());
  EXPECT_TRUE(DecodeSequence("\x05").empty());
  // A header alone: one call with an empty message.
  std::vector<Call> calls = DecodeSequence(std::string("\x0e\x01", 2));
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].rpc, Rpc::kStatus);
  EXPECT_EQ(calls[0].fixups, kLiveJob);
  EXPECT_EQ(calls[0].messages, std::vector<std::string>{""});
  // The rpc byte wraps; a length past the end takes what is there.
  calls =
      DecodeSequence(std::string("\x1d\x00\xff\xff"
                                 "abc",
                                 7));
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].rpc, Rpc::kRegisterJob);
  EXPECT_EQ(calls[0].messages, std::vector<std::string>{"abc"});
  // A client stream's count wraps at kMaxStreamMessages + 1.
  calls = DecodeSequence(std::string("\x06\x00\x07\x01\x00x\x01\x00y", 10));
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].rpc, Rpc::kPushGradient);
  EXPECT_EQ(calls[0].messages, (std::vector<std::string>{"x", "y"}));
  // At most kMaxCalls.
  std::string many;
  for (int i = 0; i < 100; ++i) many.append("\x0e\x00\x00\x00", 4);
  EXPECT_EQ(DecodeSequence(many).size(), kMaxCalls);
}

class RequestWorldTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<RequestWorld>> w = RequestWorld::Create(RequestWorld::Options());
    ASSERT_TRUE(w.ok()) << w.status();
    world_ = *std::move(w);
  }

  // Runs seed `name`, checks the invariants and restores; the calls' codes.
  std::vector<grpc::StatusCode> RunSeed(const std::string& name) {
    std::vector<grpc::StatusCode> codes;
    for (const auto& [seed, calls] : SeedSequences()) {
      if (seed != name) continue;
      for (const Call& call : calls) {
        const grpc::Status s = world_->Run(call);
        codes.push_back(s.error_code());
        if (!s.ok()) {
          std::printf("%s: %s: %d %s\n", name.c_str(), RpcName(call.rpc), s.error_code(),
                      s.error_message().c_str());
        }
      }
    }
    EXPECT_FALSE(codes.empty()) << "no seed " << name;
    return codes;
  }

  void CheckAndRestore() {
    absl::Status s = world_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
    s = world_->Restore();
    EXPECT_TRUE(s.ok()) << s;
  }

  uint64_t Committed() {
    absl::StatusOr<std::shared_ptr<Job>> live = world_->daemon().jobs().Find(kLiveJobId);
    return live.ok() ? (*live)->committed_step() : ~uint64_t{0};
  }

  std::unique_ptr<RequestWorld> world_;
};

std::vector<grpc::StatusCode> AllOk(size_t n) {
  return std::vector<grpc::StatusCode>(n, grpc::StatusCode::OK);
}

TEST_F(RequestWorldTest, ValidSeedsSucceed) {
  for (const char* name : {"observe", "two_steps", "activations_streamed", "activations_placed",
                           "staged_push", "second_job"}) {
    const std::vector<grpc::StatusCode> codes = RunSeed(name);
    EXPECT_EQ(codes, AllOk(codes.size())) << name;
    if (std::string(name) == "two_steps") EXPECT_EQ(Committed(), 2u);
    CheckAndRestore();
    EXPECT_EQ(Committed(), 0u) << "after " << name;
  }
}

TEST_F(RequestWorldTest, CheckpointSeedLoadsTheSavedStep) {
  const std::vector<grpc::StatusCode> codes = RunSeed("checkpoint_and_load");
  EXPECT_EQ(codes, AllOk(codes.size()));
  EXPECT_EQ(Committed(), 1u);
  CheckAndRestore();
  // Again: the restore emptied the checkpoint directory, so the same save
  // is not refused as existing.
  const std::vector<grpc::StatusCode> again = RunSeed("checkpoint_and_load");
  EXPECT_EQ(again, codes);
  EXPECT_EQ(Committed(), 1u);
  CheckAndRestore();
}

TEST_F(RequestWorldTest, RanksLeavingRemoveTheJobAndRestoreBringsItBack) {
  const std::vector<grpc::StatusCode> codes = RunSeed("ranks_leave");
  ASSERT_EQ(codes.size(), 5u);
  EXPECT_EQ(codes[3], grpc::StatusCode::OK);
  EXPECT_EQ(codes[4], grpc::StatusCode::NOT_FOUND);  // the job is gone
  CheckAndRestore();
  EXPECT_EQ(Committed(), 0u);
}

TEST_F(RequestWorldTest, RefusedSeedIsRefusedAndChangesNothing) {
  for (grpc::StatusCode code : RunSeed("refused")) EXPECT_NE(code, grpc::StatusCode::OK);
  CheckAndRestore();
}

TEST_F(RequestWorldTest, EverySeedKeepsTheInvariants) {
  for (const auto& [name, calls] : SeedSequences()) {
    RunSeed(name);
    CheckAndRestore();
  }
}

}  // namespace
}  // namespace zeroshard::testing
