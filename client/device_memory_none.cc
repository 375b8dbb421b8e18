// DeviceCopier of a build without CUDA (nvcc was not found when it was
// built): every request for one is refused.

#include "absl/strings/str_cat.h"
#include "client/device_memory.h"

namespace zeroshard {

bool BuiltWithCuda() { return false; }

absl::StatusOr<std::unique_ptr<DeviceCopier>> CreateDeviceCopier(int device, size_t scratch_bytes) {
  (void)scratch_bytes;
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA device ", device,
      ": this zeroshard client was built without CUDA (nvcc was not "
      "found at build time); rebuild it on a machine with the CUDA toolkit, or pass host "
      "buffers"));
}

}  // namespace zeroshard
