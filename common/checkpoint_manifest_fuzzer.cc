// libFuzzer target: the input, byte for byte, is a checkpoint's MANIFEST in
// a scratch checkpoint directory, beside the PART file and zero-filled array
// files (at most kMaxFileBytes each) of the parts it lists. The real readers
// run over it: ReadManifest, ListCompleteCheckpoints and "latest",
// CheckpointReader's CheckReadable, ReadRange and VerifyPart, then
// ReadManifest's incomplete-checkpoint path with MANIFEST removed. Every
// length in the input must be refused or bounded by the files: no read out
// of bounds, no allocation the manifest sizes (-rss_limit_mb catches one).
// Run: tools/fuzz.sh //common:checkpoint_manifest_fuzzer 60

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/checkpoint_files.h"
#include "common/job_id.h"
#include "google/protobuf/stubs/logging.h"

namespace {

// Bounds what one input writes, so a run stays fast.
constexpr uint64_t kMaxFileBytes = 64 << 10;
constexpr int kMaxParts = 8;
constexpr int kMaxFilesPerPart = 4;

// The process's scratch root (in memory where /dev/shm is), removed at exit.
const std::string& Root() {
  static const std::string* root = [] {
    const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string tmpl = std::string(base) + "/zs-manifest-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) ::abort();
    auto* r = new std::string(tmpl);
    std::atexit([] { std::filesystem::remove_all(Root()); });
    return r;
  }();
  return *root;
}

// Plain writes: no fsync, nothing atomic (the readers are under test).
void WriteFile(const std::string& path, const void* data, size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) break;
    p += w;
    n -= static_cast<size_t>(w);
  }
  ::close(fd);
}

}  // namespace

// Malformed strings make protobuf log each one; the fuzzer's output is for
// its own findings.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zeroshard;
  // The names to file it under come from the input when they are valid, so
  // that ReadManifest's own name check can pass.
  v1::CheckpointManifest m;
  const bool parsed = m.ParseFromArray(data, static_cast<int>(size));
  const std::string job = parsed && IsValidJobId(m.job_id()) ? m.job_id() : "fuzz";
  const std::string name =
      parsed && ValidateCheckpointName(m.name(), false).ok() ? m.name() : "c";
  const std::string& root = Root();
  std::filesystem::remove_all(CheckpointJobDir(root, job));
  const std::string dir = CheckpointDir(root, job, name);
  std::filesystem::create_directories(dir);
  const std::vector<char> zeros(kMaxFileBytes);
  for (int i = 0; parsed && i < std::min(m.parts_size(), kMaxParts); ++i) {
    const v1::PartManifest& p = m.parts(i);
    const std::string part_dir = CheckpointPartDir(root, job, name, p.daemon_index());
    std::filesystem::create_directories(part_dir);
    const std::string part = p.SerializeAsString();
    WriteFile(part_dir + "/" + kPartManifestFile, part.data(), part.size());
    for (int f = 0; f < std::min(p.files_size(), kMaxFilesPerPart); ++f) {
      const v1::CheckpointFile& file = p.files(f);
      if (!ValidateCheckpointName(file.name(), false).ok()) continue;
      WriteFile(part_dir + "/" + file.name(), zeros.data(),
                static_cast<size_t>(std::min(file.bytes(), kMaxFileBytes)));
    }
  }
  WriteFile(dir + "/" + kManifestFile, data, size);

  absl::StatusOr<v1::CheckpointManifest> read = ReadManifest(root, job, name);
  if (read.ok()) {
    CheckpointReader reader(root, *read);
    const uint64_t total = read->partition_map().total_elements();
    const uint64_t n = std::min<uint64_t>(total, 64);
    std::vector<float> out(n);
    for (const FlatRange range : {FlatRange{0, n}, FlatRange{total - n, total}}) {
      (void)reader.CheckReadable(range, ArrayFilesOf(read->spec()));
      for (const std::string& file : ArrayFilesOf(read->spec())) {
        (void)reader.ReadRange(file, range, out.data(), nullptr);
      }
    }
    const uint32_t parts = static_cast<uint32_t>(std::min(read->parts_size(), kMaxParts));
    for (uint32_t p = 0; p <= parts; ++p) (void)reader.VerifyPart(p, nullptr);
  }
  (void)ListCompleteCheckpoints(root, job);
  (void)ResolveCheckpointName(root, job, kLatestCheckpoint);
  ::unlink((dir + "/" + kManifestFile).c_str());
  (void)ReadManifest(root, job, name);
  return 0;
}
