#include "metrics/promql_names.h"

#include <algorithm>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "metrics/metric_names.h"

namespace zeroshard::metrics::testing {
namespace {

bool IsIdentStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         c == ':';
}
bool IsIdentChar(char c) { return IsIdentStart(c) || (c >= '0' && c <= '9'); }

std::string ToFamily(absl::string_view name) {
  for (absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
    if (!absl::EndsWith(name, suffix)) continue;
    const MetricSpec* spec =
        FindMetric(name.substr(0, name.size() - suffix.size()));
    if (spec != nullptr && spec->type == MetricType::kHistogram) {
      return std::string(spec->name);
    }
  }
  return std::string(name);
}

// A small PromQL scanner: enough to find selectors and their matchers.
class Scanner {
 public:
  explicit Scanner(absl::string_view expr) : s_(expr) {}

  std::vector<Selector> Run() {
    std::vector<Selector> selectors;
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c == '"' || c == '\'' || c == '`') {
        SkipString();
      } else if (c == '#') {
        while (i_ < s_.size() && s_[i_] != '\n') ++i_;
      } else if (IsIdentStart(c)) {
        const absl::string_view ident = Ident();
        if (!absl::StartsWith(ident, "zeroshard_")) continue;
        Selector selector;
        selector.family = ToFamily(ident);
        SkipSpace();
        if (i_ < s_.size() && s_[i_] == '{') {
          ++i_;
          Matchers(&selector.matcher_labels);
        }
        selectors.push_back(std::move(selector));
      } else if (c >= '0' && c <= '9') {  // Numbers, durations ("5m").
        while (i_ < s_.size() && IsIdentChar(s_[i_])) ++i_;
      } else {
        ++i_;
      }
    }
    return selectors;
  }

 private:
  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' ||
                              s_[i_] == '\n' || s_[i_] == '\r')) {
      ++i_;
    }
  }

  absl::string_view Ident() {
    const size_t start = i_;
    while (i_ < s_.size() && IsIdentChar(s_[i_])) ++i_;
    return s_.substr(start, i_ - start);
  }

  void SkipString() {
    const char quote = s_[i_++];
    while (i_ < s_.size() && s_[i_] != quote) {
      if (s_[i_] == '\\' && quote != '`') ++i_;
      ++i_;
    }
    ++i_;
  }

  // After `{`: label names up to the matching `}`.
  void Matchers(std::vector<std::string>* labels) {
    while (i_ < s_.size()) {
      SkipSpace();
      if (i_ >= s_.size()) return;
      const char c = s_[i_];
      if (c == '}') {
        ++i_;
        return;
      }
      if (c == '"' || c == '\'' || c == '`') {
        SkipString();
      } else if (IsIdentStart(c)) {
        labels->emplace_back(Ident());
        SkipSpace();
        while (i_ < s_.size() &&
               (s_[i_] == '=' || s_[i_] == '!' || s_[i_] == '~')) {
          ++i_;
        }
        SkipSpace();
        if (i_ < s_.size() &&
            (s_[i_] == '"' || s_[i_] == '\'' || s_[i_] == '`')) {
          SkipString();
        }
      } else {
        ++i_;
      }
    }
  }

  absl::string_view s_;
  size_t i_ = 0;
};

}  // namespace

std::vector<Selector> ZeroshardSelectorsIn(absl::string_view expr) {
  return Scanner(expr).Run();
}

std::set<std::string> ZeroshardMetricsIn(absl::string_view expr) {
  std::set<std::string> names;
  for (const Selector& s : ZeroshardSelectorsIn(expr)) names.insert(s.family);
  return names;
}

bool IsExportedMetric(absl::string_view family) {
  return FindMetric(family) != nullptr;
}

absl::Status CheckAgainstContract(absl::string_view expr) {
  std::vector<std::string> problems;
  for (const Selector& selector : ZeroshardSelectorsIn(expr)) {
    const MetricSpec* spec = FindMetric(selector.family);
    if (spec == nullptr) {
      problems.push_back(
          absl::StrCat(selector.family, " is not an exported metric"));
      continue;
    }
    std::vector<std::string> allowed = spec->LabelNames();
    allowed.push_back("instance");
    if (spec->type == MetricType::kHistogram) allowed.push_back("le");
    for (const std::string& label : selector.matcher_labels) {
      if (std::find(allowed.begin(), allowed.end(), label) == allowed.end()) {
        problems.push_back(absl::StrCat(selector.family, " has no label \"",
                                        label, "\" (it has ",
                                        absl::StrJoin(allowed, ", "), ")"));
      }
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(expr, ": ", absl::StrJoin(problems, "; ")));
}

}  // namespace zeroshard::metrics::testing
