// Checks dashboards/zeroshard.json: Grafana structure, the datasource and
// template variables, and that every query is valid PromQL (promtool) over
// metrics and labels the daemon exports (metrics/metric_names.h).

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/promql_names.h"
#include "metrics/promtool_testutil.h"

namespace zeroshard::dashboards {
namespace {

using ::zeroshard::metrics::testing::ReadRunfile;

using ::testing::IsSupersetOf;

// Just enough JSON for the checks below.
struct Json {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Json> array;
  std::vector<std::pair<std::string, Json>> object;

  const Json* Get(absl::string_view key) const {
    for (const auto& [k, v] : object) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  std::string Str(absl::string_view key) const {
    const Json* v = Get(key);
    return v != nullptr && v->kind == Kind::kString ? v->string : "";
  }
};

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : s_(text) {}

  // False, with error() set, on malformed input or trailing garbage.
  bool Parse(Json* out) {
    if (!Value(out)) return false;
    Space();
    if (i_ != s_.size()) return Fail("trailing characters");
    return true;
  }
  const std::string& error() const { return error_; }

 private:
  bool Fail(absl::string_view what) {
    if (error_.empty()) error_ = absl::StrCat(what, " at byte ", i_);
    return false;
  }
  void Space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' ||
                              s_[i_] == '\r' || s_[i_] == '\t')) {
      ++i_;
    }
  }
  bool Literal(absl::string_view word) {
    if (s_.substr(i_, word.size()) != word) return Fail("bad literal");
    i_ += word.size();
    return true;
  }
  bool Value(Json* out) {
    Space();
    if (i_ >= s_.size()) return Fail("unexpected end");
    switch (s_[i_]) {
      case '{':
        return Object(out);
      case '[':
        return Array(out);
      case '"':
        out->kind = Json::Kind::kString;
        return String(&out->string);
      case 't':
        out->kind = Json::Kind::kBool;
        out->boolean = true;
        return Literal("true");
      case 'f':
        out->kind = Json::Kind::kBool;
        return Literal("false");
      case 'n':
        return Literal("null");
      default:
        return Number(out);
    }
  }
  bool Number(Json* out) {
    const size_t start = i_;
    while (i_ < s_.size() &&
           std::string("+-0123456789.eE").find(s_[i_]) != std::string::npos) {
      ++i_;
    }
    if (i_ == start) return Fail("unexpected character");
    const std::string text(s_.substr(start, i_ - start));
    char* end = nullptr;
    out->kind = Json::Kind::kNumber;
    out->number = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size()) return Fail("bad number");
    return true;
  }
  static void AppendUtf8(unsigned cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  bool Hex4(unsigned* cp) {
    if (i_ + 4 > s_.size()) return Fail("short \\u escape");
    *cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      *cp <<= 4;
      if (c >= '0' && c <= '9')
        *cp |= c - '0';
      else if (c >= 'a' && c <= 'f')
        *cp |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        *cp |= c - 'A' + 10;
      else
        return Fail("bad \\u escape");
    }
    return true;
  }
  bool String(std::string* out) {
    ++i_;  // Opening quote.
    while (i_ < s_.size() && s_[i_] != '"') {
      const char c = s_[i_++];
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (i_ >= s_.size()) break;
      const char e = s_[i_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out->push_back(e);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          unsigned cp = 0;
          if (!Hex4(&cp)) return false;
          if (cp >= 0xD800 && cp < 0xDC00 && s_.substr(i_, 2) == "\\u") {
            i_ += 2;
            unsigned low = 0;
            if (!Hex4(&low)) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return Fail("bad escape");
      }
    }
    if (i_ >= s_.size()) return Fail("unterminated string");
    ++i_;
    return true;
  }
  bool Array(Json* out) {
    out->kind = Json::Kind::kArray;
    ++i_;
    Space();
    if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
    while (true) {
      out->array.emplace_back();
      if (!Value(&out->array.back())) return false;
      Space();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
      return Fail("expected , or ]");
    }
  }
  bool Object(Json* out) {
    out->kind = Json::Kind::kObject;
    ++i_;
    Space();
    if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
    while (true) {
      Space();
      if (i_ >= s_.size() || s_[i_] != '"') return Fail("expected key");
      std::string key;
      if (!String(&key)) return false;
      Space();
      if (i_ >= s_.size() || s_[i_] != ':') return Fail("expected :");
      ++i_;
      out->object.emplace_back(std::move(key), Json());
      if (!Value(&out->object.back().second)) return false;
      Space();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
      return Fail("expected , or }");
    }
  }

  absl::string_view s_;
  size_t i_ = 0;
  std::string error_;
};

constexpr absl::string_view kDatasourceUid = "${DS_PROMETHEUS}";

class DashboardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string text = ReadRunfile("dashboards/zeroshard.json");
    ASSERT_FALSE(text.empty()) << "dashboards/zeroshard.json not found";
    JsonParser parser(text);
    ASSERT_TRUE(parser.Parse(&dashboard_)) << parser.error();
    ASSERT_EQ(dashboard_.kind, Json::Kind::kObject);
    const Json* panels = dashboard_.Get("panels");
    ASSERT_NE(panels, nullptr);
    CollectPanels(*panels);
    const Json* templating = dashboard_.Get("templating");
    ASSERT_NE(templating, nullptr);
    const Json* list = templating->Get("list");
    ASSERT_NE(list, nullptr);
    for (const Json& variable : list->array) {
      variables_[variable.Str("name")] = &variable;
    }
  }

  void CollectPanels(const Json& panels) {
    for (const Json& panel : panels.array) {
      panels_.push_back(&panel);
      if (const Json* nested = panel.Get("panels"); nested != nullptr) {
        CollectPanels(*nested);  // Collapsed rows hold their panels.
      }
    }
  }

  // Every PromQL query: panel targets and query variables.
  std::vector<std::string> Queries() const {
    std::vector<std::string> queries;
    for (const Json* panel : panels_) {
      if (const Json* targets = panel->Get("targets"); targets != nullptr) {
        for (const Json& target : targets->array) {
          queries.push_back(target.Str("expr"));
        }
      }
    }
    for (const auto& [name, variable] : variables_) {
      if (variable->Str("type") == "query") {
        queries.push_back(variable->Str("definition"));
      }
    }
    return queries;
  }

  Json dashboard_;
  std::vector<const Json*> panels_;
  std::map<std::string, const Json*> variables_;
};

TEST_F(DashboardTest, TopLevel) {
  const Json* schema = dashboard_.Get("schemaVersion");
  ASSERT_NE(schema, nullptr);
  EXPECT_GE(schema->number, 36);
  EXPECT_LE(schema->number, 39);
  EXPECT_FALSE(dashboard_.Str("uid").empty());
  EXPECT_FALSE(dashboard_.Str("title").empty());
}

TEST_F(DashboardTest, DatasourceAndTemplateVariables) {
  ASSERT_EQ(variables_.count("DS_PROMETHEUS"), 1u);
  EXPECT_EQ(variables_["DS_PROMETHEUS"]->Str("type"), "datasource");
  EXPECT_EQ(variables_["DS_PROMETHEUS"]->Str("query"), "prometheus");
  for (const char* name : {"job", "instance"}) {
    ASSERT_EQ(variables_.count(name), 1u) << name;
    const Json& variable = *variables_[name];
    EXPECT_EQ(variable.Str("type"), "query") << name;
    ASSERT_NE(variable.Get("datasource"), nullptr) << name;
    EXPECT_EQ(variable.Get("datasource")->Str("uid"), kDatasourceUid) << name;
    EXPECT_THAT(variable.Str("definition"),
                ::testing::HasSubstr(absl::StrCat(", ", name, ")")));
  }
}

TEST_F(DashboardTest, PanelsAreWellFormed) {
  std::set<double> ids;
  int graphs = 0;
  for (const Json* panel : panels_) {
    const std::string title = panel->Str("title");
    const Json* id = panel->Get("id");
    ASSERT_NE(id, nullptr) << title;
    EXPECT_TRUE(ids.insert(id->number).second) << "duplicate id in " << title;
    const Json* grid = panel->Get("gridPos");
    ASSERT_NE(grid, nullptr) << title;
    ASSERT_NE(grid->Get("x"), nullptr);
    ASSERT_NE(grid->Get("w"), nullptr);
    EXPECT_LE(grid->Get("x")->number + grid->Get("w")->number, 24) << title;
    if (panel->Str("type") == "row") continue;
    ++graphs;
    EXPECT_FALSE(title.empty());
    ASSERT_NE(panel->Get("datasource"), nullptr) << title;
    EXPECT_EQ(panel->Get("datasource")->Str("uid"), kDatasourceUid) << title;
    const Json* targets = panel->Get("targets");
    ASSERT_NE(targets, nullptr) << title;
    ASSERT_FALSE(targets->array.empty()) << title;
    std::set<std::string> ref_ids;
    for (const Json& target : targets->array) {
      EXPECT_FALSE(target.Str("expr").empty()) << title;
      EXPECT_TRUE(ref_ids.insert(target.Str("refId")).second) << title;
      ASSERT_NE(target.Get("datasource"), nullptr) << title;
      EXPECT_EQ(target.Get("datasource")->Str("uid"), kDatasourceUid) << title;
    }
    if (const Json* repeat = panel->Get("repeat"); repeat != nullptr) {
      EXPECT_EQ(variables_.count(repeat->string), 1u) << title;
    }
  }
  EXPECT_GE(graphs, 10);
}

TEST_F(DashboardTest, QueriesUseOnlyExportedMetricsAndLabels) {
  for (const std::string& query : Queries()) {
    EXPECT_FALSE(metrics::testing::ZeroshardMetricsIn(query).empty()) << query;
    const absl::Status status = metrics::testing::CheckAgainstContract(query);
    EXPECT_TRUE(status.ok()) << status.message();
  }
}

TEST_F(DashboardTest, CoversTheDaemonsMetrics) {
  std::set<std::string> used;
  for (const std::string& query : Queries()) {
    for (const std::string& name :
         metrics::testing::ZeroshardMetricsIn(query)) {
      used.insert(name);
    }
  }
  EXPECT_THAT(used, IsSupersetOf({
                        "zeroshard_memory_bytes",
                        "zeroshard_memory_limit_bytes",
                        "zeroshard_comm_bytes_total",
                        "zeroshard_step_seconds",
                        "zeroshard_optimizer_seconds",
                        "zeroshard_optimizer_params_per_second",
                        "zeroshard_ranks_connected",
                        "zeroshard_jobs",
                        "zeroshard_requests_total",
                        "zeroshard_activation_hits_total",
                        "zeroshard_activation_misses_total",
                        "zeroshard_activation_spills_total",
                        "zeroshard_activation_spill_bytes_total",
                        "zeroshard_activation_fetch_seconds",
                        "zeroshard_checkpoint_seconds",
                        "zeroshard_checkpoint_bytes_total",
                        "zeroshard_checkpoint_last_complete_step",
                        "zeroshard_checkpoint_last_complete_timestamp_seconds",
                    }));
}

// promtool has no plain PromQL check, but `check rules` parses each rule's
// expression: wrap every panel query (variables filled in) in a recording
// rule.
TEST_F(DashboardTest, QueriesAreValidPromql) {
  std::string rules = "groups:\n  - name: dashboard_queries\n    rules:\n";
  int n = 0;
  for (const Json* panel : panels_) {
    const Json* targets = panel->Get("targets");
    if (targets == nullptr) continue;
    for (const Json& target : targets->array) {
      const std::string expr =
          absl::StrReplaceAll(target.Str("expr"), {{"$job", ".*"},
                                                   {"$instance", ".*"},
                                                   {"$__rate_interval", "5m"},
                                                   {"\\", "\\\\"},
                                                   {"\"", "\\\""}});
      absl::StrAppend(&rules, "      - record: dashboard:query_", ++n,
                      "\n        expr: \"", expr, "\"\n");
    }
  }
  const std::string promtool = metrics::testing::FindPromtool();
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not found on PATH or in /usr/bin";
  }
  const metrics::testing::CommandResult result =
      metrics::testing::RunPromtool(promtool, "check rules /dev/stdin", rules);
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n" << rules;
  EXPECT_THAT(result.output, ::testing::HasSubstr(
                                 absl::StrCat("SUCCESS: ", n, " rules found")));
}

}  // namespace
}  // namespace zeroshard::dashboards
