// Constants and small helpers shared by the ops of this library.
#ifndef TFE_ESTIMATOR_KERNELS_COMMON_H_
#define TFE_ESTIMATOR_KERNELS_COMMON_H_

#include <cstdint>

#include "aes_ctr.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/public/version.h"

namespace tfe_estimator {

// A seed is one AES-128 key, carried as 4 int32 (tf-encrypted's seed dtype).
constexpr int kSeedWords = 4;
// Work is split into chunks of this many 64-bit keystream words (32 KiB): a
// chunk starts on an AES block boundary, so its counter is known up front.
constexpr int64_t kChunkWords = 4096;
constexpr int64_t kWordsPerBlock = kBlockBytes / 8;

inline int64_t RoundUpToBlock(int64_t bytes) {
  return (bytes + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
}

// TF 2.9 spells the OK status Status::OK(), TF >= 2.10 OkStatus().
#if TF_MAJOR_VERSION == 2 && TF_MINOR_VERSION < 10
inline ::tensorflow::Status OkStatus() { return ::tensorflow::Status::OK(); }
#else
using ::tensorflow::OkStatus;
#endif

// Refuses to build a kernel in a process where the known-answer test failed.
inline void RequireSelfTest(::tensorflow::OpKernelConstruction* ctx) {
  OP_REQUIRES(ctx, AesCtrSelfTestPassed(),
              ::tensorflow::errors::Internal(
                  "AES-128-CTR known-answer test (NIST SP 800-38A F.5.1) failed in this "
                  "process: the cipher library is broken, so no secure op will run. ",
                  AesCtrSelfTest()));
}

}  // namespace tfe_estimator

#endif  // TFE_ESTIMATOR_KERNELS_COMMON_H_
