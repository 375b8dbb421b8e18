// libFuzzer target: a JobSpec as a daemon receives it in RegisterJob (bytes
// of the wire message), through ParseJobSpec (validation, the layout, the
// partition map). Nothing may crash, and an accepted spec must describe a
// consistent flat space. Run: tools/fuzz.sh //common:job_spec_fuzzer 60

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/job_spec.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "google/protobuf/stubs/logging.h"

// Malformed strings make protobuf log each one; the fuzzer's output is for
// its own findings.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zeroshard::v1::JobSpec spec;
  if (!spec.ParseFromArray(data, static_cast<int>(size))) return 0;
  // A mutated layout rarely keeps its 64-bit fingerprint: fix it up half of
  // the time, so the checks past the fingerprint are explored too.
  if (size % 2 == 0) {
    absl::StatusOr<zeroshard::Layout> layout = zeroshard::LayoutFromProto(spec.layout());
    if (layout.ok()) spec.set_layout_fingerprint(layout->fingerprint());
  }
  absl::StatusOr<zeroshard::JobConfig> config = zeroshard::ParseJobSpec(spec);
  if (!config.ok()) return 0;
  const zeroshard::PartitionMap& map = config->map;
  // The invariants the daemon relies on for an accepted spec.
  if (map.total_elements() != config->layout.total_elements() ||
      map.padded_elements() < map.total_elements() ||
      map.partition_elements() * config->world_size != map.padded_elements() ||
      config->daemons.empty() || config->daemons.size() > config->world_size) {
    std::abort();
  }
  for (uint32_t d = 0; d < config->daemons.size(); ++d) {
    const zeroshard::FlatRange r = map.DaemonRange(d);
    if (r.end > map.padded_elements()) std::abort();
  }
  // The wire form of an accepted spec parses to the same job.
  absl::StatusOr<zeroshard::JobConfig> again =
      zeroshard::ParseJobSpec(zeroshard::ToJobSpec(*config, config->layout));
  if (!again.ok() || again->layout.fingerprint() != config->layout.fingerprint() ||
      again->map.padded_elements() != map.padded_elements()) {
    std::abort();
  }
  return 0;
}
