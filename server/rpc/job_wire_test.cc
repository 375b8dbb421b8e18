#include "server/rpc/job_wire.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(JobWireTest, IncomingChunksViewTheirMessages) {
  v1::GradientChunk g;
  g.set_step(3);
  g.set_rank(1);
  g.set_incarnation(7);
  g.mutable_range()->set_begin(16);
  g.mutable_range()->set_end(20);
  g.set_dtype(v1::DTYPE_BF16);
  g.set_data(std::string(8, 'x'));
  g.add_no_grad_tensors(2);
  g.add_no_grad_tensors(5);
  const GradientChunkIn in = FromWire(g);
  EXPECT_EQ(in.payload.data(), g.data().data()) << "the payload is copied";
  EXPECT_EQ(in.no_grad_tensors.data(), g.no_grad_tensors().data());
  EXPECT_EQ(in.range.begin, 16u);
  EXPECT_EQ(in.range.end, 20u);
  EXPECT_EQ(in.dtype, static_cast<int>(v1::DTYPE_BF16));
  EXPECT_EQ(in.incarnation, 7u);

  v1::StateChunk s;
  s.set_array(v1::STATE_ARRAY_EXP_AVG);
  s.set_data(std::string(16, 'y'));
  v1::TensorStep* t = s.add_tensor_steps();
  t->set_tensor(4);
  t->set_steps(9);
  const StateChunkIn state = FromWire(s);
  EXPECT_EQ(state.data.data(), s.data().data());
  ASSERT_EQ(state.tensor_steps.size(), 1u);
  EXPECT_EQ(state.tensor_steps[0].tensor, 4u);
  EXPECT_EQ(state.tensor_steps[0].steps, 9u);
}

TEST(JobWireTest, OutgoingChunksSwapTheirBytes) {
  ParameterChunkOut out;
  out.range = {8, 12};
  out.dtype = DType::kFp32;
  out.data.assign(16, 'z');
  out.crc32c = 42;
  const char* bytes = out.data.data();
  v1::ParameterChunk message;
  SwapToWire(out, &message);
  EXPECT_EQ(message.data().data(), bytes) << "the bytes are copied";
  EXPECT_EQ(message.range().begin(), 8u);
  EXPECT_EQ(message.range().end(), 12u);
  EXPECT_EQ(message.dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(message.crc32c(), 42u);
  SwapBack(&message, out);
  EXPECT_EQ(out.data.data(), bytes) << "the engine's buffer is not given back";
}

TEST(JobWireTest, JoinAnswerOmitsTheReplacedProcessWhenNone) {
  JoinResult r;
  r.committed_step = 5;
  r.ranks_connected = 2;
  r.dropped_contributions = 3;  // ignored without a replaced incarnation
  v1::JoinJobResponse out;
  ToWire(r, &out);
  EXPECT_EQ(out.committed_step(), 5u);
  EXPECT_EQ(out.ranks_connected(), 2u);
  EXPECT_EQ(out.dropped_contributions(), 0u);
}

}  // namespace
}  // namespace zeroshard
