#include "server/testing/request_sequence.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/rpc/job_wire.h"

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

// A new RPC in the table needs a seed that calls it.
TEST(RequestSequenceTest, SeedsCallEveryRpc) {
  std::set<int> called;
  for (const auto& [name, calls] : SeedSequences()) {
    for (const Call& call : calls) called.insert(static_cast<int>(call.rpc));
  }
  for (int rpc = 0; rpc < kNumRpcs; ++rpc) {
    EXPECT_EQ(called.count(rpc), 1u) << "no seed calls " << RpcName(static_cast<Rpc>(rpc));
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
  calls = DecodeSequence(std::string(1, static_cast<char>(kNumRpcs)) +
                         std::string("\x00\xff\xff"
                                     "abc",
                                     6));
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
    // The fuzzer keeps calls short; the seeds here must pass on a loaded
    // machine, where a checkpoint's status may take longer than that.
    RequestWorld::Options options;
    options.call_deadline = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<RequestWorld>> w = RequestWorld::Create(options);
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
                           "staged_push", "second_job", "state_dict", "replica_driven"}) {
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

TEST_F(RequestWorldTest, StateSeedWritesWhatItSays) {
  std::vector<Call> calls;
  for (const auto& [name, seed] : SeedSequences()) {
    if (name == "state_dict") calls = seed;
  }
  ASSERT_GE(calls.size(), 2u);
  ASSERT_EQ(calls[0].rpc, Rpc::kWriteState);
  auto hash = [&] { return (*world_->daemon().jobs().Find(kLiveJobId))->StateHash(); };
  // Its first call writes what the daemon holds: nothing changes.
  const uint64_t before = hash();
  const grpc::Status same = world_->Run(calls[0]);
  EXPECT_TRUE(same.ok()) << same.error_message();
  EXPECT_EQ(hash(), before);
  CheckAndRestore();
  const std::vector<grpc::StatusCode> codes = RunSeed("state_dict");
  EXPECT_EQ(codes, AllOk(codes.size()));
  EXPECT_EQ(Committed(), 1u);
  // Tensors 0 and 1 were set to 3 updates, then the step updated every one.
  std::vector<float> values;
  std::vector<v1::TensorStep> steps;
  const grpc::Status read = world_->client().ReadState(
      kLiveJobId, 0, v1::STATE_ARRAY_MASTER, {0, SampleLayout().total_elements()}, &values, &steps);
  ASSERT_TRUE(read.ok()) << read.error_message();
  std::map<uint32_t, uint64_t> counts;
  for (const v1::TensorStep& t : steps) counts[t.tensor()] = t.steps();
  EXPECT_EQ(counts, (std::map<uint32_t, uint64_t>{{0, 4}, {1, 4}, {2, 1}, {3, 1}, {4, 1}, {5, 1}}));
  CheckAndRestore();
  EXPECT_EQ(Committed(), 0u);
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

// The replicated job's backup copy (group 1) as the world finds it.
v1::ReplicaGroupState Backup(RequestWorld& world) {
  v1::ReplicaGroupState state;
  absl::StatusOr<std::shared_ptr<Job>> copy =
      world.daemon().jobs().Find(kReplicaJobId, kReplicaBackupGroup);
  if (copy.ok()) {
    if (std::optional<ReplicaGroupStatus> r = (*copy)->ReplicaState(); r.has_value()) {
      ToWire(*r, &state);
    }
  }
  return state;
}

TEST_F(RequestWorldTest, ReplicaSeedsDriveTheBackup) {
  v1::ReplicaGroupState backup = Backup(*world_);
  EXPECT_EQ(backup.role(), v1::REPLICA_ROLE_BACKUP);
  EXPECT_EQ(backup.epoch(), 1u);
  EXPECT_FALSE(backup.in_sync());
  // Copied, a step forwarded and committed, promoted.
  std::vector<grpc::StatusCode> codes = RunSeed("replica_driven");
  EXPECT_EQ(codes, AllOk(7));
  backup = Backup(*world_);
  EXPECT_EQ(backup.role(), v1::REPLICA_ROLE_PRIMARY);
  EXPECT_EQ(backup.epoch(), 2u);
  EXPECT_EQ(backup.committed_step(), 1u);
  CheckAndRestore();
  backup = Backup(*world_);
  EXPECT_EQ(backup.role(), v1::REPLICA_ROLE_BACKUP);
  EXPECT_EQ(backup.epoch(), 1u);
  EXPECT_EQ(backup.committed_step(), 0u);
  EXPECT_FALSE(backup.in_sync());

  // Released: the copy is gone until the restore.
  codes = RunSeed("replica_released");
  EXPECT_EQ(codes, (std::vector<grpc::StatusCode>{grpc::StatusCode::OK, grpc::StatusCode::OK,
                                                  grpc::StatusCode::OK,
                                                  grpc::StatusCode::NOT_FOUND}));
  EXPECT_FALSE(world_->daemon().jobs().Find(kReplicaJobId, kReplicaBackupGroup).ok());
  CheckAndRestore();
  EXPECT_TRUE(world_->daemon().jobs().Find(kReplicaJobId, kReplicaBackupGroup).ok());

  codes = RunSeed("replica_refused");
  EXPECT_EQ(codes, (std::vector<grpc::StatusCode>{
                       grpc::StatusCode::FAILED_PRECONDITION,  // Promote: not in sync
                       grpc::StatusCode::FAILED_PRECONDITION,  // ForwardGradient: no copy
                       grpc::StatusCode::FAILED_PRECONDITION,  // CommitReplica: no copy
                       grpc::StatusCode::ABORTED,              // TransferState: older epoch
                       grpc::StatusCode::FAILED_PRECONDITION,  // ReleaseReplica: primary
                       grpc::StatusCode::NOT_FOUND,            // GetReplicaState: no job
                       grpc::StatusCode::FAILED_PRECONDITION,  // Promote: not replicated
                       grpc::StatusCode::DATA_LOSS,            // TransferState: CRC
                       grpc::StatusCode::INVALID_ARGUMENT,     // TransferState: an array short
                   }));
  backup = Backup(*world_);
  EXPECT_EQ(backup.role(), v1::REPLICA_ROLE_BACKUP);
  EXPECT_EQ(backup.epoch(), 1u);
  EXPECT_FALSE(backup.in_sync());
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
