// Exact discrete Gaussian noise for distributed differential privacy.
//
//   noise = TfeDiscreteGaussian(shape, variance)
//
// Each element is an independent sample of the discrete Gaussian N_Z(0, v),
// Pr[X = x] proportional to exp(-x^2 / (2 v)) on the integers, for an integer
// v = `variance` in [1, 2^100]. The sampler is Karney's exact algorithm D
// ("Sampling exactly from the normal distribution", ACM TOMS 2016) for the
// discrete Gaussian with mu = 0 and sigma = sqrt(v), in integer arithmetic
// only (no floating point touches a sample: Mironov, CCS 2012):
//
//   1. k >= 0 with Pr ~ exp(-k^2 / 2): k = the number of Bernoulli(exp(-1/2))
//      successes before the first failure, accepted if k (k - 1) more
//      Bernoulli(exp(-1/2)) all succeed;
//   2. a sign s and j uniform on [0, ceil(sigma)); m = ceil(k sigma) + j,
//      rejected if m >= ceil((k + 1) sigma) (so every m >= 0 belongs to one k)
//      or if m = 0 and s < 0 (0 counted once);
//   3. accept with probability exp(-(m^2 - k^2 v) / (2 v)) and return s m.
//
// Every m >= 0 is then output with probability proportional to
// exp(-k^2/2) exp(-(m^2 - k^2 v) / (2 v)) = exp(-m^2 / (2 v)). Bernoulli(exp(-g))
// for rational g is Canonne, Kamath, Steinke (NeurIPS 2020) Algorithm 1, and
// each Bernoulli(a / b) in it compares a uniform real, drawn bit by bit, with
// the binary expansion of a / b (about 2 random bits each), so a sample costs
// a few dozen random bits and no division.
//
// The one departure from the exact distribution: k is capped at kMaxK = 4096
// (so |X| < 2^63 fits the int64 output and every product fits 128 bits:
// m < 2^63, m^2 < 2^126, k^2 v < 2^124). A k above the cap is rejected; its
// probability is below exp(-2^23), so the output is N_Z(0, v) up to a total
// variation distance below exp(-2^23) per sample (stated in
// tfe_estimator/privacy/dp.py; nothing representable is added to delta).
//
// Randomness: bits of AES-128-CTR (EVP_aes_128_ctr, see aes_ctr.h) under a
// fresh key from RAND_bytes on every run. Chunk c of the output reads the
// counter space whose high 64 bits are c, so threads never share a stream and
// the output does not depend on how the work is split. Never std::rand, never
// TensorFlow's Philox. The noise does not depend on the data, so in a
// training graph the op has no data input and TensorFlow runs it alongside
// the forward and backward passes where cores allow.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "aes_ctr.h"
#include "common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfe_estimator {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
using u128 = unsigned __int128;

// Elements per work unit (and per AES-CTR stream).
constexpr int64_t kNoiseChunk = 1024;
// ------------------------------------------------------------- randomness --

// 64-bit words of the AES-128-CTR keystream of `key` in counter space `stream`.
class AesWords {
 public:
  AesWords(const uint8_t* key, uint64_t stream) : key_(key), stream_(stream) {}

  bool ok() const { return ok_; }

  uint64_t Next() {
    if (pos_ == kBufWords) Refill();
    return buf_[pos_++];
  }

 private:
  static constexpr int kBufWords = 1024;

  void Refill() {
    ok_ = ok_ && AesCtrKeystream(key_, stream_, block_, reinterpret_cast<uint8_t*>(buf_), sizeof(buf_));
    if (!ok_) {
      // The op fails and its output is discarded; a xorshift stream only
      // keeps the rejection loops terminating until then.
      for (auto& w : buf_) {
        fallback_ ^= fallback_ << 13, fallback_ ^= fallback_ >> 7, fallback_ ^= fallback_ << 17;
        w = fallback_;
      }
    }
    block_ += sizeof(buf_) / kBlockBytes;
    pos_ = 0;
  }

  const uint8_t* key_;
  uint64_t stream_;
  uint64_t block_ = 0;
  uint64_t buf_[kBufWords];
  int pos_ = kBufWords;
  bool ok_ = true;
  uint64_t fallback_ = 0x9e3779b97f4a7c15ull;
};

// Uniform bits from the words, without waste: bits left in a word that are
// not enough for a request are dropped (they were never looked at).
class RandomBits {
 public:
  RandomBits(const uint8_t* key, uint64_t stream) : words_(key, stream) {}

  bool ok() const { return words_.ok(); }

  uint32_t Bit() {
    if (count_ == 0) pool_ = words_.Next(), count_ = 64;
    const uint32_t b = static_cast<uint32_t>(pool_ & 1);
    pool_ >>= 1;
    --count_;
    return b;
  }

  // `n` uniform bits, 1 <= n <= 63.
  uint64_t Bits(int n) {
    if (count_ < n) pool_ = words_.Next(), count_ = 64;
    const uint64_t r = pool_ & ((1ull << n) - 1);
    pool_ >>= n;
    count_ -= n;
    return r;
  }

  // Uniform on [0, c), 1 <= c <= 2^63, by rejection (no modulo bias).
  uint64_t Below(uint64_t c) {
    if (c == 1) return 0;
    const int bits = 64 - __builtin_clzll(c - 1);
    for (;;) {
      const uint64_t x = Bits(bits);
      if (x < c) return x;
    }
  }

 private:
  AesWords words_;
  uint64_t pool_ = 0;
  int count_ = 0;
};

// ------------------------------------------------------ exact Bernoullis --

// Bernoulli(a / b) for 0 <= a <= b < 2^127: a uniform U in [0, 1), drawn bit
// by bit, against the binary expansion of a / b (long division); U < a / b
// is decided at the first differing bit. If the expansion ends (remainder 0)
// while all bits agree, U >= a / b (U = a / b has probability 0).
bool BernoulliFraction(RandomBits& rng, u128 a, u128 b) {
  if (a >= b) return true;
  if (b <= 0xffffffffull) {
    // Small denominators (the Bernoulli(exp(-1/2)) and (exp(-1)) steps): 32
    // digits of a / b per 64-bit division against 32 random bits at once.
    uint64_t r = static_cast<uint64_t>(a);
    const uint64_t d = static_cast<uint64_t>(b);
    for (;;) {
      const uint64_t shifted = r << 32;
      const uint64_t digits = shifted / d;
      r = shifted - digits * d;
      const uint64_t u = rng.Bits(32);
      if (u != digits) return u < digits;
      if (r == 0) return false;
    }
  }
  u128 r = a;
  for (;;) {
    r <<= 1;
    uint32_t digit = 0;
    if (r >= b) r -= b, digit = 1;
    const uint32_t u = rng.Bit();
    if (u != digit) return u < digit;
    if (r == 0) return false;
  }
}

// Bernoulli(exp(-a/b)) for 0 <= a <= b, b < 2^102 (CKS20 Algorithm 1,
// gamma <= 1): K <- 1; while Bernoulli(gamma / K): K <- K + 1; return K odd.
// (K reaches 2^25, where b K would pass 2^127, with probability below 1/(2^25)!.)
bool BernoulliExpSmall(RandomBits& rng, u128 a, u128 b) {
  uint64_t k = 1;
  while (BernoulliFraction(rng, a, b * k)) ++k;
  return k % 2 == 1;
}

inline bool BernoulliExpHalf(RandomBits& rng) { return BernoulliExpSmall(rng, 1, 2); }

// Bernoulli(exp(-a/b)) for any a >= 0 (CKS20 Algorithm 1): floor(a/b)
// Bernoulli(exp(-1)) trials, stopping at the first failure, then the rest.
bool BernoulliExp(RandomBits& rng, u128 a, u128 b) {
  while (a >= b) {
    if (!BernoulliExpSmall(rng, 1, 1)) return false;
    a -= b;
  }
  return BernoulliExpSmall(rng, a, b);
}

// ------------------------------------------------------------- Karney D --

// k is capped here (see the header).
constexpr uint64_t kMaxK = 4096;
constexpr int kTableK = 64;

// floor(sqrt(x)) for x < 2^127.
uint64_t FloorSqrt(u128 x) {
  uint64_t r = static_cast<uint64_t>(std::sqrt(static_cast<long double>(x)));
  while (static_cast<u128>(r) * r > x) --r;
  while (static_cast<u128>(r + 1) * (r + 1) <= x) ++r;
  return r;
}

class KarneySampler {
 public:
  explicit KarneySampler(u128 v) : v_(v), two_v_(2 * v), width_(CeilSigmaTimes(1)) {
    for (int k = 0; k < kTableK; ++k) ceil_[k] = CeilSigmaTimes(k);
  }

  int64_t Sample(RandomBits& rng) const {
    for (;;) {
      uint64_t k = 0;
      while (BernoulliExpHalf(rng)) ++k;
      if (k > kMaxK) continue;
      bool accept = true;
      for (uint64_t i = 0, n = k * (k - (k > 0)); i < n && accept; ++i) accept = BernoulliExpHalf(rng);
      if (!accept) continue;
      const bool negative = rng.Bit();
      const u128 m = Ceil(k) + rng.Below(width_);
      if (m >= Ceil(k + 1) || (m == 0 && negative)) continue;
      const u128 k2v = static_cast<u128>(k) * k * v_;
      const u128 m2 = m * m;
      if (!BernoulliExp(rng, m2 - k2v, two_v_)) continue;
      const int64_t y = static_cast<int64_t>(m);
      return negative ? -y : y;
    }
  }

 private:
  // ceil(k sqrt(v)) = the least m with m^2 >= k^2 v.
  uint64_t CeilSigmaTimes(uint64_t k) const {
    const u128 x = static_cast<u128>(k) * k * v_;
    return x == 0 ? 0 : FloorSqrt(x - 1) + 1;
  }

  uint64_t Ceil(uint64_t k) const { return k < kTableK ? ceil_[k] : CeilSigmaTimes(k); }

  u128 v_, two_v_;
  uint64_t width_;  // ceil(sigma): j is uniform on [0, width_)
  uint64_t ceil_[kTableK];
};

// ------------------------------------------------------------------- op --

REGISTER_OP("TfeDiscreteGaussian")
    .Input("shape: int64")
    .Input("variance: float64")
    .Output("noise: int64")
    .SetIsStateful()  // fresh randomness on every run; Grappler must not fold it
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(0, &out));
      c->set_output(0, out);
      return OkStatus();
    })
    .Doc(R"doc(
Independent samples of the discrete Gaussian N_Z(0, variance) on the integers
(Karney's exact algorithm with Canonne-Kamath-Steinke Bernoulli(exp(-x)), integer
arithmetic only), with randomness from
AES-128-CTR keyed by a fresh RAND_bytes key on every run. `variance` must be an
integer in [1, 2**100].
)doc");

class DiscreteGaussianOp : public OpKernel {
 public:
  explicit DiscreteGaussianOp(OpKernelConstruction* ctx) : OpKernel(ctx) { RequireSelfTest(ctx); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& shape_tensor = ctx->input(0);
    const double variance = ctx->input(1).scalar<double>()();
    OP_REQUIRES(ctx, std::isfinite(variance) && variance >= 1 && variance <= std::ldexp(1.0, 100) &&
                         std::floor(variance) == variance,
                ::tensorflow::errors::InvalidArgument(
                    "TfeDiscreteGaussian: variance must be an integer in [1, 2**100], got ", variance));
    TensorShape shape;
    OP_REQUIRES(ctx, shape_tensor.dims() == 1,
                ::tensorflow::errors::InvalidArgument("TfeDiscreteGaussian: shape must be a vector"));
    OP_REQUIRES_OK(ctx, ::tensorflow::TensorShapeUtils::MakeShape(shape_tensor.flat<int64_t>().data(),
                                                                  shape_tensor.NumElements(), &shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    uint8_t key[kKeyBytes];
    OP_REQUIRES(ctx, FreshKey(key), ::tensorflow::errors::Internal("RAND_bytes failed: no secure key"));

    const KarneySampler sampler(static_cast<u128>(variance));  // exact: an integer below 2^101
    int64_t* y = out->flat<int64_t>().data();
    const int64_t n = out->NumElements();
    const int64_t chunks = (n + kNoiseChunk - 1) / kNoiseChunk;
    std::vector<uint8_t> failed(chunks, 0);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    // Cost per element: tens of ns (python -m tfe_estimator.tools.bench.dp).
    ::tensorflow::Shard(workers->NumThreads(), workers, chunks, kNoiseChunk * 50,
                        [&](int64_t begin, int64_t end) {
                          for (int64_t c = begin; c < end; ++c) {
                            RandomBits rng(key, static_cast<uint64_t>(c));
                            const int64_t last = std::min(n, (c + 1) * kNoiseChunk);
                            for (int64_t i = c * kNoiseChunk; i < last; ++i) y[i] = sampler.Sample(rng);
                            failed[c] = !rng.ok();
                          }
                        });
    std::memset(key, 0, sizeof(key));
    for (uint8_t f : failed) OP_REQUIRES(ctx, !f, ::tensorflow::errors::Internal("AES-128-CTR failed"));
  }
};
REGISTER_KERNEL_BUILDER(Name("TfeDiscreteGaussian").Device(DEVICE_CPU).HostMemory("shape"),
                        DiscreteGaussianOp);

}  // namespace
}  // namespace tfe_estimator
