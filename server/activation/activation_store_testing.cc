#include "server/activation/activation_store_testing.h"

#include <dirent.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/disk/instance_directory.h"

namespace zeroshard::testing {

std::string PatternBytes(uint64_t seed, size_t bytes) {
  std::string s(bytes, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&s[i], &v, std::min<size_t>(8, bytes - i));
  }
  return s;
}

size_t SpillFilesIn(const std::string& dir) {
  size_t n = 0;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (InstanceDirectory::IsInstanceFileName(name, InstanceDirectory::SpillNaming().prefix) &&
        !absl::StrContains(name, ".lock")) {
      ++n;
    }
  }
  ::closedir(d);
  return n;
}

size_t SettledSpillFiles(const ActivationStore& store, const std::string& dir) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  auto settled = [&] {
    const ActivationStore::Stats st = store.GetStats();
    return st.dropped_files == 0 && st.in_flight == 0;
  };
  while (!settled() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return SpillFilesIn(dir);
}

std::string TestDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
}

}  // namespace zeroshard::testing
