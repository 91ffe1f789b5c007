// Exact discrete Gaussian noise for distributed differential privacy.
//
//   noise = TfeDiscreteGaussian(shape, variance)
//
// Each element is an independent sample of the discrete Gaussian N_Z(0, s2),
// Pr[X = x] proportional to exp(-x^2 / (2 s2)) on the integers, with
// s2 = `variance` (an integer, 1 <= s2 <= 2^100). The samplers are
// Algorithms 1-3 of Canonne, Kamath and Steinke, "The Discrete Gaussian for
// Differential Privacy" (NeurIPS 2020): Bernoulli(exp(-gamma)) for rational
// gamma, the discrete Laplace by rejection, and the discrete Gaussian by
// rejection from the discrete Laplace of scale t = floor(sqrt(s2)) + 1. Every
// step is integer arithmetic on exact rationals: no floating point touches a
// sample (floating-point noise is attackable: Mironov, CCS 2012). At the
// scale secure aggregation needs (s2 ~ 2^64 ring units) the acceptance test
// compares numbers of up to 2^240, so it uses the 256-bit integers below.
//
// Randomness: uniform integers by rejection from 64-bit words of AES-128-CTR
// (EVP_aes_128_ctr, see aes_ctr.h) under a fresh key from RAND_bytes on every
// run. Chunk c of the output reads the counter space whose high 64 bits are c,
// so threads never share a stream and the output does not depend on how the
// work is split. Never std::rand, never TensorFlow's Philox.
//
// One departure from the exact algorithm, for the 256-bit bound: a discrete
// Laplace candidate with |Y| > 2^20 * t is rejected without the final test.
// Its acceptance probability is below exp(-2^38); such a candidate itself has
// probability below exp(-2^20). The output distribution is N_Z(0, s2) up to a
// total variation distance below exp(-2^20).
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
// Candidates beyond this many t are rejected outright (see the header).
constexpr int kMaxScaleShift = 20;

// ------------------------------------------------------ 256-bit unsigned --

struct U256 {
  u128 hi = 0, lo = 0;
};

inline bool Less(const U256& a, const U256& b) { return a.hi < b.hi || (a.hi == b.hi && a.lo < b.lo); }

inline U256 Sub(const U256& a, const U256& b) {  // a - b, requires a >= b
  U256 r;
  r.lo = a.lo - b.lo;
  r.hi = a.hi - b.hi - (a.lo < b.lo ? 1 : 0);
  return r;
}

inline U256 Mul128(u128 a, u128 b) {  // full 256-bit product
  const uint64_t a0 = static_cast<uint64_t>(a), a1 = static_cast<uint64_t>(a >> 64);
  const uint64_t b0 = static_cast<uint64_t>(b), b1 = static_cast<uint64_t>(b >> 64);
  const u128 p00 = static_cast<u128>(a0) * b0, p01 = static_cast<u128>(a0) * b1;
  const u128 p10 = static_cast<u128>(a1) * b0, p11 = static_cast<u128>(a1) * b1;
  const u128 mid = (p00 >> 64) + static_cast<uint64_t>(p01) + static_cast<uint64_t>(p10);
  U256 r;
  r.lo = (mid << 64) | static_cast<uint64_t>(p00);
  r.hi = p11 + (p01 >> 64) + (p10 >> 64) + (mid >> 64);
  return r;
}

inline U256 MulSmall(const U256& a, uint64_t k) {  // a * k; callers keep it below 2^256
  const U256 lo = Mul128(a.lo, k);
  U256 r;
  r.lo = lo.lo;
  r.hi = lo.hi + a.hi * k;
  return r;
}

inline int BitLength128(u128 x) {
  const uint64_t h = static_cast<uint64_t>(x >> 64), l = static_cast<uint64_t>(x);
  if (h) return 128 - __builtin_clzll(h);
  if (l) return 64 - __builtin_clzll(l);
  return 0;
}

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

  // Uniform on [0, m), m >= 1, by rejection (no modulo bias).
  uint64_t Below(uint64_t m) {
    if (m == 1) return 0;
    const int bits = 64 - __builtin_clzll(m - 1);
    const uint64_t mask = bits == 64 ? ~0ull : ((1ull << bits) - 1);
    for (;;) {
      const uint64_t x = Next() & mask;
      if (x < m) return x;
    }
  }

  // Uniform on [0, m), m >= 1.
  U256 Below(const U256& m) {
    U256 one;
    one.lo = 1;
    const U256 top = Sub(m, one);  // the largest value allowed
    const int bits = top.hi ? 128 + BitLength128(top.hi) : BitLength128(top.lo);
    for (;;) {
      U256 x;
      x.lo = (static_cast<u128>(Next()) << 64) | Next();
      x.hi = (static_cast<u128>(Next()) << 64) | Next();
      if (bits <= 128) {
        x.hi = 0;
        if (bits < 128) x.lo &= (static_cast<u128>(1) << bits) - 1;
      } else if (bits < 256) {
        x.hi &= (static_cast<u128>(1) << (bits - 128)) - 1;
      }
      if (!Less(top, x)) return x;
    }
  }

 private:
  static constexpr int kBufWords = 256;

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

// ------------------------------------------------- Canonne-Kamath-Steinke --

// Bernoulli(exp(-n/d)) for 0 <= n <= d, d >= 1 (CKS20 Algorithm 1, gamma <= 1):
// K <- 1; while Bernoulli(gamma / K): K <- K + 1; return K odd.
bool BernoulliExpSmall(AesWords& rng, uint64_t n, uint64_t d) {
  uint64_t k = 1;
  while (rng.Below(d * k) < n) ++k;
  return k % 2 == 1;
}

bool BernoulliExpSmall(AesWords& rng, const U256& n, const U256& d) {
  uint64_t k = 1;
  while (Less(rng.Below(MulSmall(d, k)), n)) ++k;
  return k % 2 == 1;
}

inline bool BernoulliExpMinusOne(AesWords& rng) { return BernoulliExpSmall(rng, 1, 1); }

// Bernoulli(exp(-n/d)) for any n >= 0 (CKS20 Algorithm 1): floor(gamma)
// Bernoulli(exp(-1)) trials, stopping at the first failure, then the rest.
bool BernoulliExp(AesWords& rng, U256 n, const U256& d) {
  while (!Less(n, d)) {
    if (!BernoulliExpMinusOne(rng)) return false;
    n = Sub(n, d);
  }
  return BernoulliExpSmall(rng, n, d);
}

// The discrete Laplace with scale t >= 1, Pr[X = x] ~ exp(-|x| / t)
// (CKS20 Algorithm 2 with s = 1).
int64_t DiscreteLaplace(AesWords& rng, uint64_t t) {
  for (;;) {
    const uint64_t u = rng.Below(t);
    if (!BernoulliExpSmall(rng, u, t)) continue;
    uint64_t v = 0;
    while (BernoulliExpMinusOne(rng)) ++v;
    const uint64_t x = u + t * v;
    const bool negative = rng.Next() & 1;
    if (negative && x == 0) continue;
    return negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
  }
}

// N_Z(0, s2) for an integer s2 >= 1 (CKS20 Algorithm 3): t = floor(sqrt(s2)) + 1;
// accept a discrete Laplace candidate Y with probability
// exp(-(|Y| - s2/t)^2 / (2 s2)) = exp(-(|Y| t - s2)^2 / (2 s2 t^2)).
int64_t DiscreteGaussian(AesWords& rng, u128 s2, uint64_t t) {
  const U256 denominator = MulSmall(Mul128(s2, static_cast<u128>(t) * t), 2);
  const uint64_t limit = t << kMaxScaleShift;
  for (;;) {
    const int64_t y = DiscreteLaplace(rng, t);
    const uint64_t magnitude = y < 0 ? -static_cast<uint64_t>(y) : static_cast<uint64_t>(y);
    if (magnitude > limit) continue;
    const u128 yt = static_cast<u128>(magnitude) * t;
    const u128 diff = yt > s2 ? yt - s2 : s2 - yt;
    if (BernoulliExp(rng, Mul128(diff, diff), denominator)) return y;
  }
}

uint64_t FloorSqrt(u128 s2) {
  uint64_t r = static_cast<uint64_t>(std::sqrt(static_cast<long double>(s2)));
  while (static_cast<u128>(r) * r > s2) --r;
  while (static_cast<u128>(r + 1) * (r + 1) <= s2) ++r;
  return r;
}

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
(Canonne, Kamath, Steinke 2020, exact integer sampling), with randomness from
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

    const u128 s2 = static_cast<u128>(variance);  // exact: variance is an integer below 2^101
    const uint64_t t = FloorSqrt(s2) + 1;
    int64_t* y = out->flat<int64_t>().data();
    const int64_t n = out->NumElements();
    const int64_t chunks = (n + kNoiseChunk - 1) / kNoiseChunk;
    std::vector<uint8_t> failed(chunks, 0);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    // Cost per element: a few hundred ns (measured in tests/test_dp.py).
    ::tensorflow::Shard(workers->NumThreads(), workers, chunks, kNoiseChunk * 400,
                        [&](int64_t begin, int64_t end) {
                          for (int64_t c = begin; c < end; ++c) {
                            AesWords rng(key, static_cast<uint64_t>(c));
                            const int64_t last = std::min(n, (c + 1) * kNoiseChunk);
                            for (int64_t i = c * kNoiseChunk; i < last; ++i) y[i] = DiscreteGaussian(rng, s2, t);
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
