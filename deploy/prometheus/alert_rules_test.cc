// Holds deploy/prometheus to the metric contract (metrics/metric_names.h):
// every alert expression queries exported metrics and labels only, and the
// scrape job keeps the daemons' `job` label, which the rules rely on.

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/promtool_testutil.h"
#include "metrics/promql_names.h"

namespace zeroshard::deploy {
namespace {

using ::zeroshard::metrics::testing::ReadRunfile;

using ::testing::IsSupersetOf;

size_t Indent(absl::string_view line) {
  return line.find_first_not_of(' ') == absl::string_view::npos
             ? line.size()
             : line.find_first_not_of(' ');
}

struct Rule {
  std::string alert;
  std::string expr;
};

// The `- alert:` names and `expr:` values of a rules file, plain or block
// (`|`, `>`) scalars; enough YAML for alerts.yml.
std::vector<Rule> ReadRules(const std::string& text) {
  std::vector<Rule> rules;
  const std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::string_view line = absl::StripAsciiWhitespace(lines[i]);
    if (absl::ConsumePrefix(&line, "- alert:")) {
      rules.push_back({std::string(absl::StripAsciiWhitespace(line)), ""});
      continue;
    }
    if (!absl::ConsumePrefix(&line, "expr:") || rules.empty()) continue;
    line = absl::StripAsciiWhitespace(line);
    if (line != "|" && line != ">") {
      rules.back().expr = std::string(line);
      continue;
    }
    const size_t indent = Indent(lines[i]);
    while (i + 1 < lines.size() &&
           (Indent(lines[i + 1]) > indent ||
            absl::StripAsciiWhitespace(lines[i + 1]).empty())) {
      absl::StrAppend(&rules.back().expr, lines[++i], "\n");
    }
  }
  return rules;
}

TEST(AlertRulesTest, ExpressionsUseOnlyExportedMetricsAndLabels) {
  const std::string text = ReadRunfile("deploy/prometheus/alerts.yml");
  ASSERT_FALSE(text.empty());
  const std::vector<Rule> rules = ReadRules(text);
  std::vector<std::string> names;
  for (const Rule& rule : rules) {
    names.push_back(rule.alert);
    EXPECT_FALSE(rule.expr.empty()) << rule.alert;
    const absl::Status status =
        metrics::testing::CheckAgainstContract(rule.expr);
    EXPECT_TRUE(status.ok()) << rule.alert << ": " << status.message();
  }
  EXPECT_THAT(names,
              IsSupersetOf({"ZeroshardDaemonDown", "ZeroshardMemoryNearLimit",
                            "ZeroshardFragmentationHigh",
                            "ZeroshardRequestErrors", "ZeroshardRankSilent"}));
}

TEST(AlertRulesTest, ScrapeJobKeepsTheDaemonsJobLabel) {
  const std::string text = ReadRunfile("deploy/prometheus/prometheus.yml");
  ASSERT_FALSE(text.empty());
  EXPECT_TRUE(absl::StrContains(text, "job_name: zeroshard\n"));
  EXPECT_TRUE(absl::StrContains(text, "honor_labels: true"));
}

}  // namespace
}  // namespace zeroshard::deploy
