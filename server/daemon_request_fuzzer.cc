// libFuzzer target: sequences of RPCs to a live daemon, every method of its
// services but Control.Drain, with mutated request messages
// (server/testing/request_sequence.h has the input format and the fixups
// that point requests at the live job's real state). The daemon is started
// once, in this process, with a live job (two ranks joined, parameters
// initialised) and a replicated job (replicas = 2, its peer an address
// nothing listens on) whose backup copy the Replica RPCs drive (transfer,
// forward, commit, promote, release); calls have a 200 ms deadline. After
// each input the daemon must still answer Admin.Status and not be draining,
// and its ledger must never exceed the memory limit (checked after every
// call); when an input changed anything, every job is removed and the
// ledger must come back to what it held before the live job (no bytes
// leaked), then both jobs are registered again, so each input starts from
// the same state.
// Run: tools/fuzz.sh //server:daemon_request_fuzzer 60
// Seeds: bazel run //server/testing:write_request_seeds -- \
//   "$PWD/server/fuzz_corpus/daemon_request"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/stubs/logging.h"
#include "server/testing/request_sequence.h"

namespace {

using zeroshard::testing::Call;
using zeroshard::testing::RequestWorld;

RequestWorld* world = nullptr;  // never freed: the process exits with it

void Fail(const char* when, const absl::Status& status) {
  std::fprintf(stderr, "daemon_request_fuzzer: %s: %s\n", when, status.ToString().c_str());
  std::abort();
}

// libFuzzer reads its flags after this returns. Unless the command line
// says otherwise, the entropic schedule is turned off: the daemon's threads
// make each input touch tens of thousands of features, and entropic's
// per-feature bookkeeping, linear in the corpus, then took most of the
// fuzzer's time (a third of the executions per second with it on).
void AddDefaultFlags(int* argc, char*** argv) {
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp((*argv)[i], "-entropic=", 10) == 0) return;
  }
  static std::vector<char*> args;
  args.assign(*argv, *argv + *argc);
  static char entropic_off[] = "-entropic=0";
  args.push_back(entropic_off);
  args.push_back(nullptr);
  *argc += 1;
  *argv = args.data();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  AddDefaultFlags(argc, argv);
  // Malformed strings make protobuf log each one, and refused calls make
  // gRPC log; the fuzzer's output is for its own findings.
  google::protobuf::SetLogHandler(nullptr);
  setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);
  absl::StatusOr<std::unique_ptr<RequestWorld>> created =
      RequestWorld::Create(RequestWorld::Options());
  if (!created.ok()) Fail("starting the daemon", created.status());
  world = created->release();
  // Its checkpoints and spill files; the daemon itself is never stopped.
  std::atexit([] {
    std::error_code ignored;
    std::filesystem::remove_all(world->directory(), ignored);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<Call> calls = zeroshard::testing::DecodeSequence(
      absl::string_view(reinterpret_cast<const char*>(data), size));
  for (const Call& call : calls) {
    (void)world->Run(call);
    const uint64_t total = world->daemon().ledger().total();
    if (total > world->memory_limit()) {
      std::fprintf(
          stderr,
          "daemon_request_fuzzer: after %s the ledger holds %llu bytes, over the limit of %llu\n",
          zeroshard::testing::RpcName(call.rpc), static_cast<unsigned long long>(total),
          static_cast<unsigned long long>(world->memory_limit()));
      std::abort();
    }
  }
  if (absl::Status s = world->CheckInvariants(); !s.ok()) Fail("after the input", s);
  if (absl::Status s = world->Restore(); !s.ok()) Fail("restoring the daemon", s);
  return 0;
}
