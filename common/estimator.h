#pragma once

// The ZeRO paper's formulas (Rajbhandari et al., §5 and §7): model-state
// memory per rank for stages 0-3, communication volume per step, ZeRO-R
// activation-checkpoint memory, and the largest model that fits a device.
// All byte counts are per data-parallel rank, mixed-precision training with
// fp16/bf16 parameters and gradients (2 bytes each) and K bytes of optimizer
// state per parameter (K = 12 for mixed-precision Adam: fp32 master, m, v).
// EstimateDaemonStates is zeroshard's own: what one daemon holds per job.

#include <cstdint>

#include "absl/status/statusor.h"

namespace zeroshard {

inline constexpr double kAdamK = 12.0;

struct ModelStateEstimate {
  int stage = 0;
  double bytes_per_rank = 0;       // 16Ψ, 4Ψ+KΨ/N_d, 2Ψ+(2+K)Ψ/N_d, (4+K)Ψ/N_d
  double param_bytes = 0;          // half-precision parameters held per rank
  double grad_bytes = 0;           // half-precision gradients held per rank
  double optimizer_bytes = 0;      // K-byte optimizer states held per rank
  double comm_elements = 0;        // per rank per step: 2Ψ (stages 0-2), 3Ψ (stage 3)
  double comm_bytes = 0;           // comm_elements * 2 (half precision)
};

// InvalidArgument naming the field: stage outside 0..3, params <= 0 or not
// finite or above 2^63, world_size 0, k < 0 or not finite.
absl::StatusOr<ModelStateEstimate> EstimateModelStates(int stage, double params,
                                                       uint32_t world_size,
                                                       double k = kAdamK);

// Largest Ψ whose model states fit `device_bytes` at `stage` (exact quotient,
// not rounded). Same errors as above; device_bytes 0 is InvalidArgument.
absl::StatusOr<double> MaxParameters(int stage, double device_bytes, uint32_t world_size,
                                     double k = kAdamK);

// What one zeroshard daemon holds for a job it shards, mixed precision: each
// of `daemons` daemons owns Ψ/daemons elements and holds, per owned element,
// the fp32 gradient accumulator (4 B) and the half-precision copy (2 B) in
// RAM, plus the fp32 master and moments (K bytes) in RAM, or on its
// --state_dir behind a constant set of chunk buffers.
struct DaemonStateEstimate {
  double ram_bytes = 0;             // (K + 4 + 2)Ψ/D: every model state in RAM
  double state_dir_ram_bytes = 0;   // (4 + 2)Ψ/D + kStateDirBufferBytes
  double state_dir_disk_bytes = 0;  // KΨ/D (the file rounds up to whole chunks)
  // With --state_dir --state_gradients the fp32 gradient is a file mapping
  // on the same disk too (the kernel pages it; its resident pages come and
  // go with memory pressure): RAM keeps the half-precision copy.
  double state_gradients_ram_bytes = 0;   // 2Ψ/D + kStateDirBufferBytes
  double state_gradients_disk_bytes = 0;  // (K + 4)Ψ/D
};

// The RAM a job on --state_dir keeps for streaming its file: DiskResidence's
// default 4 buffers x 3 slots (master, m, v) x 2^18-element chunks x 4 B.
inline constexpr double kStateDirBufferBytes = 4.0 * 3 * (1 << 18) * 4;

// InvalidArgument naming the field: params <= 0 or not finite or above 2^63,
// daemons 0, k < 0 or not finite.
absl::StatusOr<DaemonStateEstimate> EstimateDaemonStates(double params, uint32_t daemons,
                                                         double k = kAdamK);

// ZeRO-R activation checkpoints of a transformer: one checkpoint of B*T*H
// half-precision elements per layer.
struct ActivationEstimate {
  double checkpoint_bytes = 0;         // per rank, checkpoints replicated across MP
  double partitioned_bytes = 0;        // P_a: divided by the MP degree
  double partitioned_cpu_device_bytes = 0;  // P_a+cpu: on the device (0)
  double partitioned_cpu_host_bytes = 0;    // P_a+cpu: in host memory
  double mp_comm_bytes_per_layer = 0;  // Megatron MP all-reduces: 12*B*T*H elements * 2 B
  double pa_comm_bytes_per_layer = 0;  // P_a's extra all-gather: B*T*H elements * 2 B
};

// InvalidArgument naming the field for any non-positive input.
absl::StatusOr<ActivationEstimate> EstimateActivations(double batch, double seq_len,
                                                       double hidden, double layers,
                                                       double mp_degree);

}  // namespace zeroshard
