#include "client/testing/ranks.h"

#include <stdlib.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace zeroshard::testing {

std::string FreshDir(absl::string_view prefix) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string tmpl = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", prefix, "-XXXXXX");
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr) << tmpl;
  return tmpl;
}

void RunRanks(uint32_t world, const std::function<void(uint32_t)>& fn) {
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

}  // namespace zeroshard::testing
