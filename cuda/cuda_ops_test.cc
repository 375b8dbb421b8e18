// Runs on a GPU machine (tag "gpu"); skips where no CUDA device is visible.

#include "cuda/cuda_ops.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard::cuda {
namespace {

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<int> n = DeviceCount();
    if (!n.ok()) GTEST_SKIP() << n.status();
  }
};

TEST_F(CudaOpsTest, PackUnpackMatchTheScalarReference) {
  const size_t n = 1 << 20;
  std::vector<float> host(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (auto& x : host) x = dist(rng);
  host[0] = std::numeric_limits<float>::infinity();
  host[1] = 1e30f;
  float *src, *back;
  uint16_t* packed;
  ASSERT_EQ(cudaMalloc(&src, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&back, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&packed, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src, host.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  for (DType t : {DType::kBf16, DType::kFp16}) {
    ASSERT_TRUE(PackFromFloat(src, packed, t, n, nullptr).ok());
    std::vector<uint16_t> got(n);
    ASSERT_EQ(cudaMemcpy(got.data(), packed, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<uint16_t> want(n);
    FromFloat(t, host.data(), want.data(), n);
    EXPECT_EQ(got, want) << DTypeName(t);
    ASSERT_TRUE(UnpackToFloat(packed, t, back, n, nullptr).ok());
    std::vector<float> unpacked(n), ref(n);
    ASSERT_EQ(cudaMemcpy(unpacked.data(), back, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ToFloat(t, want.data(), ref.data(), n);
    EXPECT_EQ(0, std::memcmp(unpacked.data(), ref.data(), n * 4)) << DTypeName(t);
  }
  cudaFree(src);
  cudaFree(back);
  cudaFree(packed);
}

TEST_F(CudaOpsTest, UnscaleFindsOverflow) {
  const size_t n = 4097;
  std::vector<float> host(n, 1024.0f);
  float* grads;
  int* flag;
  ASSERT_EQ(cudaMalloc(&grads, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&flag, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(grads, host.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  auto overflow = UnscaleAndCheckOverflow(grads, n, 512.0f, flag, nullptr);
  ASSERT_TRUE(overflow.ok());
  EXPECT_FALSE(*overflow);
  ASSERT_EQ(cudaMemcpy(host.data(), grads, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host[n - 1], 2.0f);
  host[77] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(cudaMemcpy(grads, host.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  overflow = UnscaleAndCheckOverflow(grads, n, 2.0f, flag, nullptr);
  ASSERT_TRUE(overflow.ok());
  EXPECT_TRUE(*overflow);
  EXPECT_FALSE(UnscaleAndCheckOverflow(grads, n, 0.0f, flag, nullptr).ok());
  cudaFree(grads);
  cudaFree(flag);
}

TEST_F(CudaOpsTest, AddIntoFloatSumsEachDtypeInFp32) {
  const size_t n = 100003;
  std::vector<float> base(n), add(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (size_t i = 0; i < n; ++i) base[i] = dist(rng), add[i] = dist(rng);
  float *dst, *src;
  ASSERT_EQ(cudaMalloc(&dst, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&src, n * 4), cudaSuccess);
  for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    std::vector<uint8_t> wire(n * DTypeSize(t));
    if (t == DType::kFp32) {
      std::memcpy(wire.data(), add.data(), n * 4);
    } else {
      FromFloat(t, add.data(), wire.data(), n);
    }
    std::vector<float> as_float(n);
    ToFloat(t, wire.data(), as_float.data(), n);
    ASSERT_EQ(cudaMemcpy(dst, base.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(src, wire.data(), wire.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(AddIntoFloat(src, t, dst, n, nullptr).ok());
    std::vector<float> got(n);
    ASSERT_EQ(cudaMemcpy(got.data(), dst, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[i], base[i] + as_float[i]) << DTypeName(t) << " element " << i;
    }
  }
  cudaFree(dst);
  cudaFree(src);
}

}  // namespace
}  // namespace zeroshard::cuda
