// Writes the seed corpus of //server:daemon_request_fuzzer
// (SeedSequences(), one file per seed) into the directory given, which must
// exist:
//   bazel run //server/testing:write_request_seeds -- \
//     "$PWD/server/fuzz_corpus/daemon_request"

#include <cstdio>
#include <fstream>
#include <string>

#include "server/testing/request_sequence.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_request_seeds DIRECTORY\n");
    return 2;
  }
  for (const auto& [name, calls] : zeroshard::testing::SeedSequences()) {
    const std::string path = std::string(argv[1]) + "/" + name;
    const std::string bytes = zeroshard::testing::EncodeSequence(calls);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "write_request_seeds: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("%s: %zu calls, %zu bytes\n", path.c_str(), calls.size(), bytes.size());
  }
  return 0;
}
