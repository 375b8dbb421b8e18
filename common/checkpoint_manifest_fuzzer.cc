// libFuzzer target: a checkpoint's MANIFEST as it is read from disk, through
// CheckManifest and then CheckpointReader's range reads against a directory
// holding no part files (every read must fail cleanly, never touch memory
// out of bounds). Run: tools/fuzz.sh //common:checkpoint_manifest_fuzzer 60

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/checkpoint_files.h"
#include "google/protobuf/stubs/logging.h"

// Malformed strings make protobuf log each one; the fuzzer's output is for
// its own findings.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zeroshard::v1::CheckpointManifest m;
  if (!m.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (!zeroshard::CheckManifest(m).ok()) return 0;
  // An accepted manifest: its parts tile [0, total); read a little of each.
  zeroshard::CheckpointReader reader("/nonexistent-zeroshard-fuzz", m);
  const uint64_t total = m.partition_map().total_elements();
  const zeroshard::FlatRange range{0, total < 64 ? total : 64};
  (void)reader.CheckReadable(range, zeroshard::ArrayFilesOf(m.spec()));
  std::vector<float> out(range.size());
  (void)reader.ReadRange(zeroshard::kMasterFile, range, out.data(), nullptr);
  for (uint32_t p = 0; p < static_cast<uint32_t>(m.parts_size()) + 1; ++p) {
    (void)reader.VerifyPart(p, nullptr);
  }
  return 0;
}
