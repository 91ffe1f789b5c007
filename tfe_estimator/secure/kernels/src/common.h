// Constants and small helpers shared by the ops of this library.
#ifndef TFE_ESTIMATOR_KERNELS_COMMON_H_
#define TFE_ESTIMATOR_KERNELS_COMMON_H_

#include <algorithm>
#include <cstdint>

#include "aes_ctr.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/public/version.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfe_estimator {

// A seed is one AES-128 key, carried as 4 int32 (tf-encrypted's seed dtype).
constexpr int kSeedWords = 4;
// Work is split into chunks of this many 64-bit keystream words (32 KiB): a
// chunk starts on an AES block boundary, so its counter is known up front.
constexpr int64_t kChunkWords = 4096;
constexpr int64_t kWordsPerBlock = kBlockBytes / 8;

// How many chunks `n` elements of `words_per_element` keystream words make.
inline int64_t NumChunks(int64_t n, int words_per_element) {
  const int64_t per_chunk = kChunkWords / words_per_element;
  return (n + per_chunk - 1) / per_chunk;
}

// Runs work(chunk index, first element, element count) over the chunks of
// `n` elements on TensorFlow's intra-op thread pool. A chunk starts on an AES
// block boundary, so its keystream can be drawn without the chunks before it.
template <typename Work>
void ForEachChunk(::tensorflow::OpKernelContext* ctx, int64_t n, int words_per_element, Work work) {
  const int64_t per_chunk = kChunkWords / words_per_element;
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  ::tensorflow::Shard(workers->NumThreads(), workers, NumChunks(n, words_per_element), kChunkWords * 4,
                      [&](int64_t begin, int64_t end) {
                        for (int64_t c = begin; c < end; ++c) {
                          const int64_t first = c * per_chunk;
                          work(c, first, std::min(per_chunk, n - first));
                        }
                      });
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
