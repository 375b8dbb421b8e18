#include "transport/ucx/ucx_tls.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard::transport::ucx {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// ucp_context_print_info() of UCX 1.13.1 with UCX_TLS unset, on a host with
// eth0 and no RDMA.
constexpr char kDefaultInfo[] = R"(#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  sysv
#     component 3  :  posix
#     component 4  :  ib
#     component 5  :  rdmacm
#     component 6  :  cma
#
#            md 0  :  component 0  self 
#            md 1  :  component 1  tcp 
#            md 2  :  component 2  sysv 
#            md 3  :  component 3  posix 
#            md 4  :  component 6  cma 
#
#      resource 0  :  md 0  dev 0  flags -- self/memory0
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 1  dev 2  flags -- tcp/lo
#      resource 3  :  md 2  dev 3  flags -- sysv/memory
#      resource 4  :  md 3  dev 3  flags -- posix/memory
#      resource 5  :  md 4  dev 3  flags -- cma/memory
#
)";

TEST(SelectedTransportsTest, ReadsEachResourceLineOnce) {
  EXPECT_THAT(SelectedTransports(kDefaultInfo),
              ElementsAre("self", "tcp", "sysv", "posix", "cma"));
  EXPECT_THAT(SelectedTransports(
                  "#      resource 0  :  md 0  dev 0  flags a- ud_mlx5/mlx5_0:1\n"
                  "#      resource 1  :  md 0  dev 0  flags -- rc_mlx5/mlx5_0:1"),
              ElementsAre("ud_mlx5", "rc_mlx5"));
}

TEST(SelectedTransportsTest, NothingFromOtherText) {
  EXPECT_THAT(SelectedTransports(""), IsEmpty());
  EXPECT_THAT(SelectedTransports("#     component 1  :  tcp\n#  md 0 : x/y"),
              IsEmpty());
  EXPECT_THAT(SelectedTransports("# resource 0 : no slash here\n# resource 1 : /dev"),
              IsEmpty());
}

TEST(DecideKeyEnforcementTest, SharedMemoryOnlyIsEnforced) {
  EXPECT_TRUE(DecideKeyEnforcement("posix,cma,self", {"self", "posix", "cma"}).enforced);
  EXPECT_TRUE(DecideKeyEnforcement("sm", {"sysv", "posix", "cma"}).enforced);
  const KeyEnforcement yes = DecideKeyEnforcement("posix", {"posix"});
  EXPECT_THAT(yes.reason, IsEmpty());
}

// The adapter checks the keys of RDMA accesses, but UCX also serves put and
// get messages that carry an address and no key, on every connection.
TEST(DecideKeyEnforcementTest, RdmaIsNot) {
  for (const char* tls : {" rc_x , sm,self", "ib", "ud", "dc_mlx5,self"}) {
    SCOPED_TRACE(tls);
    const KeyEnforcement no = DecideKeyEnforcement(tls, {"rc_mlx5", "ud_mlx5", "posix", "self"});
    EXPECT_FALSE(no.enforced);
    EXPECT_THAT(no.reason, HasSubstr("(RDMA)"));
    EXPECT_THAT(no.reason, HasSubstr("carry no key"));
  }
  // What UCX selected decides too.
  EXPECT_FALSE(DecideKeyEnforcement("sm", {"posix", "rc_verbs"}).enforced);
}

// The daemon's former table, kept: anything that leaves UCX a choice that may
// be tcp does not count, whatever UCX picked on this host.
TEST(DecideKeyEnforcementTest, TcpOrUcxsOwnChoiceIsNot) {
  const std::vector<std::string> shm = {"self", "sysv", "posix", "cma"};
  for (const char* tls : {"", "  ", "tcp", "^tcp", "posix,tcp", "all", "posix,cuda_copy"}) {
    SCOPED_TRACE(tls);
    const KeyEnforcement no = DecideKeyEnforcement(tls, shm);
    EXPECT_FALSE(no.enforced);
    EXPECT_THAT(no.reason, HasSubstr("UCX_TLS"));
  }
  EXPECT_THAT(DecideKeyEnforcement("^tcp", shm).reason, HasSubstr("exclusion"));
  EXPECT_FALSE(CheckRequestedTls("tcp").enforced);
  EXPECT_TRUE(CheckRequestedTls("posix,cma,self").enforced);
  EXPECT_THAT(DecideKeyEnforcement("tcp", {"tcp"}).reason, HasSubstr("names tcp"));
  EXPECT_THAT(DecideKeyEnforcement("all", shm).reason, HasSubstr("\"all\""));
}

TEST(DecideKeyEnforcementTest, WhatUcxSelectedMustBeSafeToo) {
  // A safe request that UCX expanded into something else.
  const KeyEnforcement no = DecideKeyEnforcement("sm", {"posix", "cuda_ipc"});
  EXPECT_FALSE(no.enforced);
  EXPECT_THAT(no.reason, HasSubstr("cuda_ipc"));
  // Nothing parsed from UCX's report: not enforced.
  EXPECT_FALSE(DecideKeyEnforcement("posix,cma,self", {}).enforced);
}

}  // namespace
}  // namespace zeroshard::transport::ucx
