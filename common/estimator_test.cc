#include "common/estimator.h"

#include <cmath>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// Decimal gigabytes rounded to three significant figures, as the paper prints.
double Gb3(double bytes) {
  const double gb = bytes / 1e9;
  const double mag = std::pow(10.0, std::floor(std::log10(gb)) - 2);
  return std::round(gb / mag) * mag;
}

TEST(Estimator, PaperFigure1) {
  // Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
  const double expected[] = {120, 31.4, 16.6, 1.88};
  for (int stage = 0; stage <= 3; ++stage) {
    auto e = EstimateModelStates(stage, 7.5e9, 64);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_NEAR(Gb3(e->bytes_per_rank), expected[stage], 1e-9) << "stage " << stage;
  }
  EXPECT_DOUBLE_EQ(EstimateModelStates(0, 7.5e9, 64)->bytes_per_rank, 16 * 7.5e9);
}

TEST(Estimator, TrillionParametersOn1024Ranks) {
  // The paper: "about 16 GB" per device; exactly 16e12/1024 = 15.625e9 bytes,
  // which rounds to 16 GB at the paper's precision (whole gigabytes).
  auto e = EstimateModelStates(3, 1e12, 1024);
  ASSERT_TRUE(e.ok());
  EXPECT_DOUBLE_EQ(e->bytes_per_rank, 16e12 / 1024);
  EXPECT_EQ(std::round(e->bytes_per_rank / 1e9), 16);
}

TEST(Estimator, LargestModelOn32GbAt64Ranks) {
  // The paper quotes 7.5B, 14B, 128B: the exact quotients (7.64B, 14.4B,
  // 128B) rounded down to a multiple of 0.5B parameters.
  const double expected[] = {7.5e9, 14e9, 128e9};
  for (int stage = 1; stage <= 3; ++stage) {
    auto max = MaxParameters(stage, 32e9, 64);
    ASSERT_TRUE(max.ok());
    EXPECT_EQ(std::floor(*max / 0.5e9) * 0.5e9, expected[stage - 1]) << "stage " << stage;
  }
  // Plain data parallelism: 32 GB / 16 B = 2B parameters of model states.
  EXPECT_DOUBLE_EQ(*MaxParameters(0, 32e9, 64), 2e9);
}

TEST(Estimator, CommunicationVolume) {
  for (int stage = 0; stage <= 2; ++stage) {
    EXPECT_DOUBLE_EQ(EstimateModelStates(stage, 1e6, 8)->comm_elements, 2e6);
  }
  EXPECT_DOUBLE_EQ(EstimateModelStates(3, 1e6, 8)->comm_elements, 3e6);
  EXPECT_DOUBLE_EQ(EstimateModelStates(3, 1e6, 8)->comm_bytes, 6e6);
}

TEST(Estimator, OtherOptimizerK) {
  // SGD with momentum in mixed precision: K = 8 (master + momentum).
  auto e = EstimateModelStates(1, 1e9, 4, 8);
  EXPECT_DOUBLE_EQ(e->bytes_per_rank, 4e9 + 8e9 / 4);
}

TEST(Estimator, DaemonStates) {
  EXPECT_EQ(kStateDirBufferBytes, 12.0 * 1024 * 1024);
  // Ψ = 3e9 on 2 daemons, Adam: 1.5e9 owned elements each; 18 B each in RAM,
  // or 6 B in RAM (gradient, half copy) beside the 12 MiB of chunk buffers
  // and 12 B on disk.
  absl::StatusOr<DaemonStateEstimate> e = EstimateDaemonStates(3e9, 2);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->ram_bytes, 27e9);
  EXPECT_EQ(e->state_dir_ram_bytes, 9e9 + 12582912);
  EXPECT_EQ(e->state_dir_disk_bytes, 18e9);
  // --state_gradients: the half copy in RAM, the gradient on disk too.
  EXPECT_EQ(e->state_gradients_ram_bytes, 3e9 + 12582912);
  EXPECT_EQ(e->state_gradients_disk_bytes, 24e9);
  // SGD with momentum (K = 8), Ψ = 1e9 on 4 daemons: 2.5e8 owned elements.
  e = EstimateDaemonStates(1e9, 4, 8);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->ram_bytes, 3.5e9);
  EXPECT_EQ(e->state_dir_ram_bytes, 1.5e9 + 12582912);
  EXPECT_EQ(e->state_dir_disk_bytes, 2e9);
  EXPECT_EQ(e->state_gradients_ram_bytes, 0.5e9 + 12582912);
  EXPECT_EQ(e->state_gradients_disk_bytes, 3e9);
  // One daemon owns everything: ZeRO's baseline plus the fp32 gradient.
  e = EstimateDaemonStates(7.5e9, 1);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->ram_bytes, 18 * 7.5e9);
}

TEST(Estimator, Activations) {
  // Paper §6.1: 100B model, B=32, T=1024, MP=16: per-layer checkpoint of
  // B*T*H half elements; P_a divides by the MP degree, P_a+cpu leaves ~0.
  auto a = EstimateActivations(32, 1024, 8192, 124, 16);
  ASSERT_TRUE(a.ok());
  EXPECT_DOUBLE_EQ(a->checkpoint_bytes, 2.0 * 32 * 1024 * 8192 * 124);
  EXPECT_NEAR(a->checkpoint_bytes / 1e9, 66.6, 0.1);
  EXPECT_DOUBLE_EQ(a->partitioned_bytes, a->checkpoint_bytes / 16);
  EXPECT_EQ(a->partitioned_cpu_device_bytes, 0);
  // P_a adds under a tenth of Megatron's MP traffic per layer.
  EXPECT_LT(a->pa_comm_bytes_per_layer, a->mp_comm_bytes_per_layer / 10);
}

TEST(Estimator, RejectsBadInputNamingTheField) {
  auto field_of = [](absl::Status s) { return std::string(s.message()); };
  EXPECT_NE(field_of(EstimateModelStates(4, 1e9, 8).status()).find("stage"), std::string::npos);
  EXPECT_NE(field_of(EstimateModelStates(1, 0, 8).status()).find("params"), std::string::npos);
  EXPECT_NE(field_of(EstimateModelStates(1, -5, 8).status()).find("params"), std::string::npos);
  EXPECT_NE(field_of(EstimateModelStates(1, NAN, 8).status()).find("params"), std::string::npos);
  EXPECT_NE(field_of(EstimateModelStates(1, 1e20, 8).status()).find("params"),
            std::string::npos);
  EXPECT_NE(field_of(EstimateModelStates(1, 1e9, 0).status()).find("world_size"),
            std::string::npos);
  EXPECT_NE(field_of(EstimateModelStates(1, 1e9, 8, -1).status()).find("optimizer_k"),
            std::string::npos);
  EXPECT_NE(field_of(MaxParameters(1, 0, 8).status()).find("device_memory"), std::string::npos);
  EXPECT_NE(field_of(EstimateActivations(0, 1, 1, 1, 1).status()).find("batch"),
            std::string::npos);
  EXPECT_EQ(EstimateModelStates(1, 0, 8).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(field_of(EstimateDaemonStates(1e9, 0).status()).find("daemons"), std::string::npos);
  EXPECT_NE(field_of(EstimateDaemonStates(0, 2).status()).find("params"), std::string::npos);
  EXPECT_NE(field_of(EstimateDaemonStates(INFINITY, 2).status()).find("params"),
            std::string::npos);
  EXPECT_NE(field_of(EstimateDaemonStates(1e9, 2, NAN).status()).find("optimizer_k"),
            std::string::npos);
  EXPECT_EQ(EstimateDaemonStates(1e9, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
