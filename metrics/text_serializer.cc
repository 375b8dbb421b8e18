#include "metrics/text_serializer.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace zeroshard::metrics {
namespace {

void AppendEscaped(absl::string_view in, bool quote, std::string* out) {
  for (char c : in) {
    switch (c) {
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '"':
        if (quote) {
          out->append("\\\"");
        } else {
          out->push_back(c);
        }
        break;
      default:
        out->push_back(c);
    }
  }
}

// `name{a="x",b="y",le="0.5"} value\n`; `le` is omitted when empty.
void AppendSample(absl::string_view name, const Labels& labels,
                  absl::string_view le, absl::string_view value,
                  std::string* out) {
  out->append(name.data(), name.size());
  if (!labels.empty() || !le.empty()) {
    out->push_back('{');
    bool first = true;
    const auto append_label = [&](absl::string_view n, absl::string_view v) {
      if (!first) out->push_back(',');
      first = false;
      absl::StrAppend(out, n, "=\"");
      AppendEscaped(v, /*quote=*/true, out);
      out->push_back('"');
    };
    for (const auto& [label_name, label_value] : labels) {
      append_label(label_name, label_value);
    }
    if (!le.empty()) append_label("le", le);
    out->push_back('}');
  }
  absl::StrAppend(out, " ", value, "\n");
}

}  // namespace

std::string FormatDouble(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  AppendEscaped(help, /*quote=*/false, &out);
  return out;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  AppendEscaped(value, /*quote=*/true, &out);
  return out;
}

std::string TextSerializer::Serialize(
    const std::vector<MetricFamily>& families) const {
  std::string out;
  for (const MetricFamily& family : families) {
    if (family.metrics.empty()) continue;
    absl::StrAppend(&out, "# HELP ", family.name, " ");
    AppendEscaped(family.help, /*quote=*/false, &out);
    absl::StrAppend(&out, "\n# TYPE ", family.name, " ",
                    MetricTypeName(family.type), "\n");
    for (const ClientMetric& metric : family.metrics) {
      if (family.type != MetricType::kHistogram) {
        AppendSample(family.name, metric.labels, "", FormatDouble(metric.value),
                     &out);
        continue;
      }
      const std::string bucket_name = absl::StrCat(family.name, "_bucket");
      for (const ClientMetric::Bucket& bucket : metric.buckets) {
        AppendSample(bucket_name, metric.labels,
                     FormatDouble(bucket.upper_bound),
                     absl::StrCat(bucket.cumulative_count), &out);
      }
      AppendSample(absl::StrCat(family.name, "_sum"), metric.labels, "",
                   FormatDouble(metric.sample_sum), &out);
      AppendSample(absl::StrCat(family.name, "_count"), metric.labels, "",
                   absl::StrCat(metric.sample_count), &out);
    }
  }
  return out;
}

}  // namespace zeroshard::metrics
