#include "common/estimator.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

absl::Status CheckParams(double params) {
  if (!std::isfinite(params) || params <= 0 || params > 9.2e18) {
    return absl::InvalidArgumentError(
        absl::StrCat("params: must be a positive finite count below 2^63, got ", params));
  }
  return absl::OkStatus();
}

absl::Status CheckK(double k) {
  if (!std::isfinite(k) || k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer_k: must be a finite K >= 0, got ", k));
  }
  return absl::OkStatus();
}

absl::Status CheckCommon(int stage, double params, uint32_t world_size, double k) {
  if (stage < 0 || stage > 3) {
    return absl::InvalidArgumentError(absl::StrCat("stage: must be 0..3, got ", stage));
  }
  if (absl::Status s = CheckParams(params); !s.ok()) return s;
  if (world_size == 0) {
    return absl::InvalidArgumentError("world_size: N_d must be >= 1, got 0");
  }
  return CheckK(k);
}

// Bytes per parameter held by one rank at `stage`.
double BytesPerParam(int stage, uint32_t world_size, double k, double* param, double* grad,
                     double* optim) {
  const double nd = world_size;
  *param = stage >= 3 ? 2.0 / nd : 2.0;
  *grad = stage >= 2 ? 2.0 / nd : 2.0;
  *optim = stage >= 1 ? k / nd : k;
  return *param + *grad + *optim;
}

}  // namespace

absl::StatusOr<ModelStateEstimate> EstimateModelStates(int stage, double params,
                                                       uint32_t world_size, double k) {
  if (absl::Status s = CheckCommon(stage, params, world_size, k); !s.ok()) return s;
  double p, g, o;
  BytesPerParam(stage, world_size, k, &p, &g, &o);
  ModelStateEstimate e;
  e.stage = stage;
  e.param_bytes = p * params;
  e.grad_bytes = g * params;
  e.optimizer_bytes = o * params;
  e.bytes_per_rank = e.param_bytes + e.grad_bytes + e.optimizer_bytes;
  e.comm_elements = (stage == 3 ? 3.0 : 2.0) * params;
  e.comm_bytes = 2.0 * e.comm_elements;
  return e;
}

absl::StatusOr<double> MaxParameters(int stage, double device_bytes, uint32_t world_size,
                                     double k) {
  if (absl::Status s = CheckCommon(stage, 1, world_size, k); !s.ok()) return s;
  if (!std::isfinite(device_bytes) || device_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_memory: must be positive, got ", device_bytes));
  }
  double p, g, o;
  return device_bytes / BytesPerParam(stage, world_size, k, &p, &g, &o);
}

absl::StatusOr<DaemonStateEstimate> EstimateDaemonStates(double params, uint32_t daemons,
                                                         double k) {
  if (absl::Status s = CheckParams(params); !s.ok()) return s;
  if (daemons == 0) return absl::InvalidArgumentError("daemons: must be >= 1, got 0");
  if (absl::Status s = CheckK(k); !s.ok()) return s;
  const double owned = params / daemons;
  DaemonStateEstimate e;
  e.ram_bytes = (k + 4 + 2) * owned;
  e.state_dir_ram_bytes = (4 + 2) * owned + kStateDirBufferBytes;
  e.state_dir_disk_bytes = k * owned;
  e.state_gradients_ram_bytes = 2 * owned + kStateDirBufferBytes;
  e.state_gradients_disk_bytes = (k + 4) * owned;
  return e;
}

absl::StatusOr<ActivationEstimate> EstimateActivations(double batch, double seq_len,
                                                       double hidden, double layers,
                                                       double mp_degree) {
  const struct {
    const char* name;
    double value;
  } inputs[] = {{"batch", batch}, {"seq_len", seq_len}, {"hidden", hidden},
                {"layers", layers}, {"mp_degree", mp_degree}};
  for (const auto& in : inputs) {
    if (!std::isfinite(in.value) || in.value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(in.name, ": must be positive, got ", in.value));
    }
  }
  const double bth = batch * seq_len * hidden;
  ActivationEstimate e;
  e.checkpoint_bytes = 2.0 * bth * layers;
  e.partitioned_bytes = e.checkpoint_bytes / mp_degree;
  e.partitioned_cpu_device_bytes = 0;
  e.partitioned_cpu_host_bytes = e.partitioned_bytes;
  e.mp_comm_bytes_per_layer = 2.0 * 12.0 * bth;
  e.pa_comm_bytes_per_layer = 2.0 * bth;
  return e;
}

}  // namespace zeroshard
