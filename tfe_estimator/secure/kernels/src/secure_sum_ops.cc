// The fused kernels of Pond's secure sum, one pass over the data each.
//
//   replica r:      share_r, seed_r = TfeMaskShare(x_r)   with share_r = enc(x_r) - AES(seed_r)
//   server0, 1:     partial_k = TfeServerSum(seeds it holds, masked shares it holds)
//                   = sum of AES(seed) over its seeds + sum of its masked shares
//   destination:    y = TfeRevealSum(partial_0, partial_1) = dec(partial_0 + partial_1)
//
// With one download per destination instead of two (the default of fused_sum):
//   server0:        blinded, key = TfeServerSum(..., num_blind=1)
//                   = partial_0 - AES(key) under a fresh key drawn on server0
//   server1:        w = TfeServerSum(its seeds, its shares + [blinded]) = sum - AES(key)
//   destination:    y = TfeRevealSum(shares=[w], keys=[key]) = dec(w + AES(key))
// server1 then holds partial_0 masked by a keystream whose key it never sees;
// server0 learns nothing it did not hold; the destination downloads n ring
// elements and a 16-byte key instead of 2n ring elements.
//
// Each replica's share pair (AES(seed_r), share_r) is Pond's 2-out-of-2
// additive sharing of enc(x_r) in the ring Z_{2^R}, R = 64 or 128 (the seed is
// the compressed form of the share AES(seed_r)). Each server holds, per
// replica, either a fresh random key or enc(x_r) minus a keystream under a
// key it never sees, so every value it receives is uniform on the ring.
//
// Ring elements are int64 tensors: shape [n] for R = 64, [n, 2] (low word,
// high word) for R = 128, whose memory layout is that of a little-endian
// unsigned __int128, and [ceil(n/2)] for R = 32, two little-endian uint32
// lanes per int64 (an odd n's last lane encodes 0). Element i's mask is
// keystream bytes [i*R/8, (i+1)*R/8) read as a little-endian integer. All
// ring arithmetic is unsigned, so it wraps modulo 2^R by definition.
//
// The 32-bit ring carries clipped float updates only (the caller derives the
// scale from the clipping bound): TfeMaskShare rounds x * 2**F to an integer
// at random, up with probability equal to the fraction (unbiased), from the
// keystream of a second fresh key that never leaves the op.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "aes_ctr.h"
#include "common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfe_estimator {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
using u128 = unsigned __int128;
using i128 = __int128;

::tensorflow::Status RingShape(InferenceContext* c, DimensionHandle n, int output) {
  int ring_bits;
  TF_RETURN_IF_ERROR(c->GetAttr("ring_bits", &ring_bits));
  if (ring_bits == 32) {
    c->set_output(output, c->Vector(c->ValueKnown(n) ? c->MakeDim((c->Value(n) + 1) / 2) : c->UnknownDim()));
  } else {
    c->set_output(output, ring_bits == 64 ? c->Vector(n) : c->Matrix(n, 2));
  }
  return OkStatus();
}

::tensorflow::Status ReadRingBits(OpKernelConstruction* ctx, int* ring_bits) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("ring_bits", ring_bits));
  if (*ring_bits != 32 && *ring_bits != 64 && *ring_bits != 128) {
    return ::tensorflow::errors::InvalidArgument("ring_bits must be 32, 64 or 128, got ", *ring_bits);
  }
  return OkStatus();
}

// 64-bit words of a ring vector of n elements.
inline int64_t RingWords(int64_t n, int ring_bits) {
  return ring_bits == 32 ? (n + 1) / 2 : n * (ring_bits / 64);
}

TensorShape RingTensorShape(int64_t n, int ring_bits) {
  if (ring_bits == 32) return TensorShape({RingWords(n, 32)});
  return ring_bits == 64 ? TensorShape({n}) : TensorShape({n, 2});
}

// a += b (or -= b) over `words` 64-bit words of ring elements, lane by lane.
inline void RingAdd(uint8_t* a, const uint8_t* b, int64_t words, int ring_bits, bool subtract = false) {
  if (ring_bits == 32) {
    uint32_t* x = reinterpret_cast<uint32_t*>(a);
    const uint32_t* y = reinterpret_cast<const uint32_t*>(b);
    if (subtract) {
      for (int64_t j = 0; j < 2 * words; ++j) x[j] -= y[j];
    } else {
      for (int64_t j = 0; j < 2 * words; ++j) x[j] += y[j];
    }
  } else if (ring_bits == 64) {
    uint64_t* x = reinterpret_cast<uint64_t*>(a);
    const uint64_t* y = reinterpret_cast<const uint64_t*>(b);
    if (subtract) {
      for (int64_t j = 0; j < words; ++j) x[j] -= y[j];
    } else {
      for (int64_t j = 0; j < words; ++j) x[j] += y[j];
    }
  } else {
    for (int64_t j = 0; j < words / 2; ++j) {
      u128 x, y;
      std::memcpy(&x, a + j * 16, 16);
      std::memcpy(&y, b + j * 16, 16);
      x = subtract ? x - y : x + y;
      std::memcpy(a + j * 16, &x, 16);
    }
  }
}


// The bound as a user wrote it: 16777216, not 1.67772e+07 (TF 2.9's StrCat).
std::string FormatBound(double bound) {
  if (bound == std::floor(bound) && bound < 9.2e18) return std::to_string(static_cast<int64_t>(bound));
  return std::to_string(bound);
}

// |v| < bound for an integer v and a bound that is a whole number (<= 2**63).
inline bool InIntegerRange(int64_t v, double bound) {
  if (bound >= 9223372036854775808.0) return v != std::numeric_limits<int64_t>::min();  // 2**63
  const int64_t limit = static_cast<int64_t>(bound);  // exact: bound is a whole number < 2**63
  return v > -limit && v < limit;
}

// Several tensors read as one vector: element i of the vector is element
// i - offsets[k] of tensor k. ForSegments(first, count, f) calls
// f(k, index in tensor k, index in [0, count), length) for each piece of the
// range [first, first + count) that lies in one tensor.
struct Segments {
  std::vector<int64_t> offsets{0};  // offsets[k] = elements before tensor k; back() = total

  void Add(int64_t size) { offsets.push_back(offsets.back() + size); }
  int64_t total() const { return offsets.back(); }

  template <typename F>
  void ForSegments(int64_t first, int64_t count, F f) const {
    int64_t k = std::upper_bound(offsets.begin(), offsets.end(), first) - offsets.begin() - 1;
    for (int64_t done = 0; done < count; ++k) {
      const int64_t begin = first + done - offsets[k];
      const int64_t len = std::min(count - done, offsets[k + 1] - offsets[k] - begin);
      if (len > 0) f(k, begin, done, len);
      done += std::max<int64_t>(len, 0);
    }
  }
};

// |x| < bound, false for NaN; integers compared exactly.
template <typename T>
inline bool InRange(T x, double bound) {
  if (std::is_floating_point<T>::value) return std::fabs(static_cast<double>(x)) < bound;
  return InIntegerRange(static_cast<int64_t>(x), bound);
}

// round_toward_zero(x * 2**F) for a value in range: multiplying by a power of
// two is exact in double for float32 and float64, and the cast truncates
// toward zero, like tf.cast. Integers are taken as they are.
template <typename T>
inline int64_t Encode64(T x, double scale) {
  return std::is_floating_point<T>::value ? static_cast<int64_t>(static_cast<double>(x) * scale)
                                          : static_cast<int64_t>(x);
}

// The 32-bit ring's encoding of `len` values with random rounding, masked (module comment): per element
// v = x * scale (0 if |x| >= bound or NaN), enc = floor(v) + [u * 2**-32 < v - floor(v)], d = enc - d (d held
// the mask). Only int32 <-> double conversions (|v| < 2**30), no library call per element: floor(v) by
// truncation, lowered by one where that is above v; the coin double(u) as double(u - 2**31) + 2**31. Returns
// false if an element was out of range (or NaN).
template <typename T>
inline bool RoundAndMask32Scalar(const T* xs, const uint32_t* u, uint32_t* d, int64_t begin, int64_t len,
                                 double scale, double bound) {
  constexpr double kCoinScale = 1.0 / 4294967296.0;
  bool bad = false;
  for (int64_t j = begin; j < len; ++j) {
    const bool ok = InRange(xs[j], bound);
    bad |= !ok;
    const double v = ok ? static_cast<double>(xs[j]) * scale : 0.0;
    int32_t low = static_cast<int32_t>(v);
    low -= static_cast<double>(low) > v;  // floor(v)
    const double coin = static_cast<double>(static_cast<int32_t>(u[j] ^ 0x80000000u)) + 2147483648.0;
    // Up with probability v - low: E[enc] = v (to 2**-32).
    const uint32_t up = coin * kCoinScale < v - static_cast<double>(low);
    d[j] = static_cast<uint32_t>(low) + up - d[j];
  }
  return !bad;
}

template <typename T>
inline bool RoundAndMask32(const T* xs, const uint32_t* u, uint32_t* d, int64_t len, double scale, double bound) {
  return RoundAndMask32Scalar(xs, u, d, 0, len, scale, bound);
}

#if defined(__SSE2__)
// Float values (a model's gradients) four at a time in SSE2's double lanes: the same operations and roundings
// as the loop above, element by element (tests/test_wire.py holds the rounding to its expectation).
template <>
inline bool RoundAndMask32<float>(const float* xs, const uint32_t* u, uint32_t* d, int64_t len, double scale,
                                  double bound) {
  const __m128d magnitude = _mm_castsi128_pd(_mm_set1_epi64x(0x7FFFFFFFFFFFFFFFLL));
  const __m128d bounds = _mm_set1_pd(bound), scales = _mm_set1_pd(scale), one = _mm_set1_pd(1.0);
  const __m128d coin_scale = _mm_set1_pd(1.0 / 4294967296.0), half_range = _mm_set1_pd(2147483648.0);
  const __m128i flip = _mm_set1_epi32(static_cast<int>(0x80000000u));
  __m128d all_ok = _mm_castsi128_pd(_mm_set1_epi32(-1));
  // one pair of elements: their encodings as two int32 in the low half
  auto pair = [&](__m128d x, __m128i coins) {
    const __m128d ok = _mm_cmplt_pd(_mm_and_pd(x, magnitude), bounds);  // false for NaN
    all_ok = _mm_and_pd(all_ok, ok);
    const __m128d v = _mm_and_pd(_mm_mul_pd(x, scales), ok);
    const __m128d truncated = _mm_cvtepi32_pd(_mm_cvttpd_epi32(v));
    const __m128d low = _mm_sub_pd(truncated, _mm_and_pd(_mm_cmpgt_pd(truncated, v), one));  // floor(v)
    const __m128d coin = _mm_add_pd(_mm_cvtepi32_pd(_mm_xor_si128(coins, flip)), half_range);
    const __m128d up = _mm_and_pd(_mm_cmplt_pd(_mm_mul_pd(coin, coin_scale), _mm_sub_pd(v, low)), one);
    return _mm_cvttpd_epi32(_mm_add_pd(low, up));  // exact: an integer below 2**30 + 1 in magnitude
  };
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {
    const __m128 x = _mm_loadu_ps(xs + j);
    const __m128i coins = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + j));
    const __m128i enc01 = pair(_mm_cvtps_pd(x), coins);
    const __m128i enc23 = pair(_mm_cvtps_pd(_mm_movehl_ps(x, x)), _mm_shuffle_epi32(coins, 0xEE));
    __m128i* out = reinterpret_cast<__m128i*>(d + j);
    _mm_storeu_si128(out, _mm_sub_epi32(_mm_unpacklo_epi64(enc01, enc23), _mm_loadu_si128(out)));
  }
  const bool tail_ok = RoundAndMask32Scalar(xs, u, d, j, len, scale, bound);
  return tail_ok && _mm_movemask_pd(all_ok) == 3;
}
#endif

// ---------------------------------------------------------------- replica --

REGISTER_OP("TfeMaskShare")
    .Input("values: N * T")  // read as one vector, in order: no concat before the op
    .Input("noise: num_noise * int64")  // differential privacy: 0 or 1 tensor
    .Input("key: num_key * int32")  // 0 tensors: a fresh key here; 1: this key (drawn before, e.g. TfeAesSeed)
    .Output("share: int64")
    .Output("seed: int32")
    .Attr("T: {float, double, int32, int64}")
    .Attr("N: int >= 1")
    .Attr("ring_bits: int")
    .Attr("fraction_bits: int >= 0")
    .Attr("bound_log2: int >= 0")  // |values| < 2**bound_log2; an attr, so no constant crosses tasks
    .Attr("owner: string")
    .Attr("hint: string")
    .Attr("num_noise: int >= 0 = 0")
    .Attr("num_key: int >= 0 = 0")
    .SetIsStateful()  // a fresh seed on every run
    .SetShapeFn([](InferenceContext* c) {
      int num_values;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &num_values));
      DimensionHandle n = c->MakeDim(0);
      for (int k = 0; k < num_values && c->ValueKnown(n); ++k) {
        ShapeHandle in = c->input(k);
        DimensionHandle size = c->MakeDim(1);
        if (!c->RankKnown(in)) {
          n = c->UnknownDim();
          break;
        }
        for (int i = 0; i < c->Rank(in); ++i) TF_RETURN_IF_ERROR(c->Multiply(size, c->Dim(in, i), &size));
        TF_RETURN_IF_ERROR(c->Add(n, size, &n));
      }
      TF_RETURN_IF_ERROR(RingShape(c, n, 0));
      c->set_output(1, c->Vector(kSeedWords));
      return OkStatus();
    })
    .Doc(R"doc(
Checks, fixed-point encodes and masks one replica's values in one pass.
The N tensors of `values` are read as one vector (their elements in order).

share = round_toward_zero(values * 2**fraction_bits) - AES-128-CTR(seed) mod 2**ring_bits,
with seed a fresh key from RAND_bytes. Refuses NaN/Inf and |values| >= 2**bound_log2 with
an error naming `owner` and `hint` but no value (the magnitude is logged here).
With num_noise = 1, `noise` (int64, one element per value, e.g. discrete Gaussian
noise for differential privacy) is added to the encoded values modulo
2**ring_bits before masking, so it never leaves this op unmasked.
With num_key = 1, `key` (int32[4], a key drawn before the op, e.g. by TfeAesSeed, so
that it can leave the graph while the values are still computed) is the seed instead
of a fresh one; it must never mask two vectors.
)doc");

template <typename T>
class MaskShareOp : public OpKernel {
 public:
  explicit MaskShareOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    RequireSelfTest(ctx);
    OP_REQUIRES_OK(ctx, ReadRingBits(ctx, &ring_bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fraction_bits", &fraction_bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("owner", &owner_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bound_log2", &bound_log2_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hint", &hint_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_noise", &num_noise_));
    OP_REQUIRES(ctx, num_noise_ <= 1,
                ::tensorflow::errors::InvalidArgument("num_noise must be 0 or 1, got ", num_noise_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_key", &num_key_));
    OP_REQUIRES(ctx, num_key_ <= 1,
                ::tensorflow::errors::InvalidArgument("num_key must be 0 or 1, got ", num_key_));
    OP_REQUIRES(ctx, ring_bits_ != 32 || (std::is_floating_point<T>::value && num_noise_ == 0),
                ::tensorflow::errors::InvalidArgument(
                    "the 32-bit ring carries clipped float updates without noise only"));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList values;
    OP_REQUIRES_OK(ctx, ctx->input_list("values", &values));
    Segments segments;
    std::vector<const T*> inputs;
    for (int k = 0; k < values.size(); ++k) {
      segments.Add(values[k].NumElements());
      inputs.push_back(values[k].flat<T>().data());
    }
    const double bound = std::ldexp(1.0, bound_log2_);
    const int64_t* noise = nullptr;  // differential privacy noise in ring units, or none
    if (num_noise_ == 1) {
      const Tensor& noise_tensor = ctx->input(values.size());
      OP_REQUIRES(ctx, noise_tensor.NumElements() == segments.total(),
                  ::tensorflow::errors::InvalidArgument("noise has ", noise_tensor.NumElements(),
                                                        " elements, values ", segments.total()));
      noise = noise_tensor.flat<int64_t>().data();
    }
    // An encoded value must fit the signed ring and its int64/int128 carrier
    // (on the 32-bit ring with one unit to spare for the random rounding).
    const int carrier_bits = ring_bits_ == 32 ? 30 : ring_bits_ == 64 ? 63 : 126;
    OP_REQUIRES(ctx, bound > 0 && std::ldexp(bound, fraction_bits_) <= std::ldexp(1.0, carrier_bits),
                ::tensorflow::errors::InvalidArgument("bound ", bound, " with ", fraction_bits_,
                                                      " fraction bits does not fit the ", ring_bits_, "-bit ring"));
    const int64_t n = segments.total();
    Tensor* share = nullptr;
    Tensor* seed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RingTensorShape(n, ring_bits_), &share));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({kSeedWords}), &seed));
    uint8_t* key = reinterpret_cast<uint8_t*>(seed->flat<int32_t>().data());
    if (num_key_ == 1) {
      const Tensor& given = ctx->input(values.size() + num_noise_);
      OP_REQUIRES(ctx, given.dims() == 1 && given.NumElements() == kSeedWords,
                  ::tensorflow::errors::InvalidArgument("key must be int32[", kSeedWords, "], got shape ",
                                                        given.shape().DebugString()));
      std::memcpy(key, given.flat<int32_t>().data(), kKeyBytes);
    } else {
      OP_REQUIRES(ctx, FreshKey(key), ::tensorflow::errors::Internal("RAND_bytes failed: no secure seed"));
    }

    uint8_t* out = reinterpret_cast<uint8_t*>(share->flat<int64_t>().data());
    const double scale = std::ldexp(1.0, fraction_bits_);
    // The 32-bit ring rounds at random from a second key's keystream: local to this op.
    uint8_t round_key[kKeyBytes];
    OP_REQUIRES(ctx, ring_bits_ != 32 || FreshKey(round_key),
                ::tensorflow::errors::Internal("RAND_bytes failed: no secure seed"));
    // Work in chunks of 64-bit words, each a whole number of elements.
    const int64_t total_words = RingWords(n, ring_bits_);
    const int per_word = ring_bits_ == 32 ? 2 : 1;  // elements per word (128: 2 words per element)
    const int words = ring_bits_ == 128 ? 2 : 1;
    const int64_t chunks = NumChunks(total_words, 1);
    std::vector<uint8_t> nonfinite(chunks, 0), out_of_range(chunks, 0), cipher_failed(chunks, 0);
    std::vector<double> largest(chunks, 0.0);
    ForEachChunk(ctx, total_words, 1, [&](int64_t c, int64_t first_word, int64_t word_count) {
      uint8_t* dst = out + first_word * 8;
      if (!AesCtrKeystream(key, 0, first_word / kWordsPerBlock, dst, word_count * 8)) {
        cipher_failed[c] = 1;
        return;
      }
      const int64_t first = first_word * per_word / words;
      const int64_t count = std::min(word_count * per_word / words, n - first);
      std::unique_ptr<uint8_t[]> coins;  // 32-bit ring: one uniform uint32 per element
      if (ring_bits_ == 32) {
        coins.reset(new uint8_t[word_count * 8]);
        if (!AesCtrKeystream(round_key, 0, first_word / kWordsPerBlock, coins.get(), word_count * 8)) {
          cipher_failed[c] = 1;
          return;
        }
        uint32_t* d = reinterpret_cast<uint32_t*>(dst);
        if (count < 2 * word_count) d[count] = 0u - d[count];  // an odd n's padding lane: encodes 0
      }
      // The hot loop has no branch: an element out of range (or NaN, which
      // fails every comparison) is encoded as 0 and flagged; the flags are
      // inspected once per chunk, and only a failing chunk is walked again
      // to tell NaN from range and find the magnitude for the owner's log.
      const int64_t* ns = noise ? noise + first : nullptr;
      bool bad = false;
      segments.ForSegments(first, count, [&](int64_t k, int64_t begin, int64_t at, int64_t len) {
        const T* xs = inputs[k] + begin;
        if (ring_bits_ == 32) {
          uint32_t* d = reinterpret_cast<uint32_t*>(dst) + at;
          const uint32_t* u = reinterpret_cast<const uint32_t*>(coins.get()) + at;
          bad |= !RoundAndMask32(xs, u, d, len, scale, bound);
        } else if (words == 1) {
          uint64_t* d = reinterpret_cast<uint64_t*>(dst) + at;
          const int64_t* nz = ns ? ns + at : nullptr;
          for (int64_t j = 0; j < len; ++j) {
            const bool ok = InRange(xs[j], bound);
            bad |= !ok;
            const uint64_t enc = ok ? static_cast<uint64_t>(Encode64(xs[j], scale)) : 0;
            const uint64_t noised = enc + (nz ? static_cast<uint64_t>(nz[j]) : 0);
            d[j] = noised - d[j];  // d[j] held the mask
          }
        } else {
          uint8_t* d = dst + at * 16;
          const int64_t* nz = ns ? ns + at : nullptr;
          for (int64_t j = 0; j < len; ++j) {
            const bool ok = InRange(xs[j], bound);
            bad |= !ok;
            const i128 enc = ok ? (std::is_floating_point<T>::value
                                       ? static_cast<i128>(static_cast<double>(xs[j]) * scale)
                                       : static_cast<i128>(xs[j]))
                                : 0;
            u128 mask;
            std::memcpy(&mask, d + j * 16, 16);
            // The int64 noise is sign-extended to the 128-bit ring.
            const u128 noised = static_cast<u128>(enc) + (nz ? static_cast<u128>(static_cast<i128>(nz[j])) : 0);
            const u128 share = noised - mask;
            std::memcpy(d + j * 16, &share, 16);
          }
        }
      });
      if (!bad) return;
      double big = 0.0;
      segments.ForSegments(first, count, [&](int64_t k, int64_t begin, int64_t, int64_t len) {
        for (int64_t j = 0; j < len; ++j) {
          const T xv = inputs[k][begin + j];
          const double v = static_cast<double>(xv);
          if (std::is_floating_point<T>::value && !std::isfinite(v)) {
            nonfinite[c] = 1;
          } else {
            big = std::max(big, std::fabs(v));
            if (!InRange(xv, bound)) out_of_range[c] = 1;
          }
        }
      });
      largest[c] = big;
    });
    bool any_nonfinite = false, any_out_of_range = false, any_failed = false;
    double big = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      any_nonfinite |= nonfinite[c];
      any_out_of_range |= out_of_range[c];
      any_failed |= cipher_failed[c];
      big = std::max(big, largest[c]);
    }
    OP_REQUIRES(ctx, !any_failed, ::tensorflow::errors::Internal("AES-128-CTR failed"));
    if (any_nonfinite || any_out_of_range) {
      // The magnitude stays on this (the owner's) host: the error travels to
      // the chief, which must not learn a value computed from this owner's data.
      LOG(WARNING) << "tfe_estimator: refused the values of " << owner_ << ": "
                   << (any_nonfinite ? "NaN or infinite elements; " : "") << "largest finite magnitude "
                   << big << ", limit " << bound;
    }
    OP_REQUIRES(ctx, !any_nonfinite,
                ::tensorflow::errors::InvalidArgument(
                    "Secure aggregation refused the values of ", owner_,
                    ": they contain NaN or infinite elements, which fixed-point encoding cannot "
                    "represent (training has diverged or the input data has NaN/Inf). Check the "
                    "input data and lower the learning rate."));
    OP_REQUIRES(ctx, !any_out_of_range,
                ::tensorflow::errors::InvalidArgument(
                    "Secure aggregation refused the values of ", owner_,
                    ": an element's magnitude is not below the fixed-point limit ", FormatBound(bound),
                    ", so encoding it would wrap around the ring (the magnitude is logged on that "
                    "owner's host only). ", hint_));
  }

 private:
  int ring_bits_;
  int fraction_bits_;
  std::string owner_;
  std::string hint_;
  int bound_log2_;
  int num_noise_;
  int num_key_;
};

#define REGISTER_MASK(T) \
  REGISTER_KERNEL_BUILDER(Name("TfeMaskShare").Device(DEVICE_CPU).TypeConstraint<T>("T"), MaskShareOp<T>);
REGISTER_MASK(float)
REGISTER_MASK(double)
REGISTER_MASK(int32_t)
REGISTER_MASK(int64_t)
#undef REGISTER_MASK

// ----------------------------------------------------------------- server --

REGISTER_OP("TfeServerSum")
    .Input("seeds: num_seeds * int32")
    .Input("shares: num_shares * int64")
    .Output("sum: int64")
    .Output("blind_key: num_blind * int32")
    .Attr("num_seeds: int >= 0")
    .Attr("num_shares: int >= 0")
    .Attr("ring_bits: int")
    .Attr("num_elements: int >= 0")
    .Attr("num_blind: int >= 0 = 0")  // 1: subtract AES(fresh key) and output the key
    .SetIsStateful()  // num_blind = 1 draws a fresh key per run: never fold or dedupe
    .SetShapeFn([](InferenceContext* c) {
      int64_t n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_elements", &n));
      int num_blind;
      TF_RETURN_IF_ERROR(c->GetAttr("num_blind", &num_blind));
      if (num_blind == 1) c->set_output(1, c->Vector(kSeedWords));
      return RingShape(c, c->MakeDim(n), 0);
    })
    .Doc(R"doc(
One server's part of a Pond sum: the sum, modulo 2**ring_bits, of the masks
AES-128-CTR(seed) of the seeds it holds and of the masked shares it holds.
With num_blind = 1, minus AES-128-CTR(blind_key) under a fresh key that is
output too (for the destinations only, never for the other server).
)doc");

class ServerSumOp : public OpKernel {
 public:
  explicit ServerSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    RequireSelfTest(ctx);
    OP_REQUIRES_OK(ctx, ReadRingBits(ctx, &ring_bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_elements", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_seeds", &num_seeds_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shares", &num_shares_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_blind", &num_blind_));
    OP_REQUIRES(ctx, num_blind_ == 0 || num_blind_ == 1,
                ::tensorflow::errors::InvalidArgument("num_blind must be 0 or 1, got ", num_blind_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t total_words = RingWords(n_, ring_bits_);
    const uint8_t* blind_key = nullptr;
    if (num_blind_ == 1) {
      Tensor* key = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({kSeedWords}), &key));
      uint8_t* bytes = reinterpret_cast<uint8_t*>(key->flat<int32_t>().data());
      OP_REQUIRES(ctx, FreshKey(bytes), ::tensorflow::errors::Internal("RAND_bytes failed"));
      blind_key = bytes;
    }
    std::vector<const uint8_t*> keys, shares;
    for (int i = 0; i < num_seeds_; ++i) {
      const Tensor& seed = ctx->input(i);
      OP_REQUIRES(ctx, seed.NumElements() == kSeedWords,
                  ::tensorflow::errors::InvalidArgument("seed ", i, " must have 4 int32, got shape ",
                                                        seed.shape().DebugString()));
      keys.push_back(reinterpret_cast<const uint8_t*>(seed.flat<int32_t>().data()));
    }
    for (int i = 0; i < num_shares_; ++i) {
      const Tensor& share = ctx->input(num_seeds_ + i);
      OP_REQUIRES(ctx, share.NumElements() == total_words,
                  ::tensorflow::errors::InvalidArgument("share ", i, " has ", share.NumElements(),
                                                        " int64, expected ", total_words));
      shares.push_back(reinterpret_cast<const uint8_t*>(share.flat<int64_t>().data()));
    }
    Tensor* sum = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, RingTensorShape(n_, ring_bits_), &sum));
    uint8_t* out = reinterpret_cast<uint8_t*>(sum->flat<int64_t>().data());
    // Chunks of 64-bit words (each a whole number of elements): ring
    // elements never straddle a chunk, and a chunk starts on an AES block.
    const int64_t chunks = NumChunks(total_words, 1);
    std::vector<uint8_t> failed(chunks, 0);
    ForEachChunk(ctx, total_words, 1, [&](int64_t c, int64_t first, int64_t count) {
      const int64_t offset = first * 8, bytes = count * 8;
      std::unique_ptr<uint8_t[]> stream;  // for the second key on: no zero-filling
      auto add = [&](const uint8_t* src) { RingAdd(out + offset, src, count, ring_bits_); };
      // The first addend is written, not added: one pass fewer.
      size_t next_key = 0;
      if (!keys.empty()) {
        if (!AesCtrKeystream(keys[0], 0, first / kWordsPerBlock, out + offset, bytes)) {
          failed[c] = 1;
          return;
        }
        next_key = 1;
      } else {
        std::memset(out + offset, 0, bytes);
      }
      for (const uint8_t* share : shares) add(share + offset);
      for (size_t k = next_key; k < keys.size(); ++k) {
        if (!stream) stream.reset(new uint8_t[bytes]);
        if (!AesCtrKeystream(keys[k], 0, first / kWordsPerBlock, stream.get(), bytes)) {
          failed[c] = 1;
          return;
        }
        add(stream.get());
      }
      if (blind_key != nullptr) {  // out -= AES(blind_key)
        if (!stream) stream.reset(new uint8_t[bytes]);
        if (!AesCtrKeystream(blind_key, 0, first / kWordsPerBlock, stream.get(), bytes)) {
          failed[c] = 1;
          return;
        }
        RingAdd(out + offset, stream.get(), count, ring_bits_, /*subtract=*/true);
      }
    });
    for (uint8_t f : failed) OP_REQUIRES(ctx, !f, ::tensorflow::errors::Internal("AES-128-CTR failed"));
  }

 private:
  int ring_bits_;
  int64_t n_;
  int num_seeds_;
  int num_shares_;
  int num_blind_;
};
REGISTER_KERNEL_BUILDER(Name("TfeServerSum").Device(DEVICE_CPU), ServerSumOp);

// ------------------------------------------------------------ destination --

REGISTER_OP("TfeRevealSum")
    .Input("shares: num_shares * int64")
    .Input("keys: num_keys * int32")  // a blinded part's key: its keystream is added
    .Output("values: N * T")
    .Attr("num_shares: int >= 1 = 2")
    .Attr("num_keys: int >= 0 = 0")
    .Attr("T: {float, double, int32, int64}")
    .Attr("N: int >= 1 = 1")
    .Attr("ring_bits: int")
    .Attr("fraction_bits: int >= 0")
    .Attr("divisor: int >= 1 = 1")  // floats are divided by it (a MEAN over replicas)
    .Attr("shapes: list(shape) = []")  // of the N outputs (no split after the op); default one [n]
    .SetShapeFn([](InferenceContext* c) {
      std::vector<::tensorflow::PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      if (shapes.empty()) {
        c->set_output(0, c->Vector(c->Dim(c->input(0), 0)));
        return OkStatus();
      }
      for (size_t k = 0; k < shapes.size(); ++k) {
        ShapeHandle out;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[k], &out));
        c->set_output(k, out);
      }
      return OkStatus();
    })
    .Doc(R"doc(
Adds the two servers' parts of a sum modulo 2**ring_bits and decodes it (the
two parts are two shares, or one blinded share and the blind key; or one part,
the sum already revealed, which is only decoded):
floats as signed(sum) * 2**-fraction_bits / divisor (one rounding), integers
exactly (an error if the sum does not fit T).
)doc");

template <typename T>
class RevealSumOp : public OpKernel {
 public:
  explicit RevealSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    RequireSelfTest(ctx);
    OP_REQUIRES_OK(ctx, ReadRingBits(ctx, &ring_bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fraction_bits", &fraction_bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &shapes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("divisor", &divisor_));
    int num_outputs;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_outputs));
    OP_REQUIRES(ctx, shapes_.empty() ? num_outputs == 1 : static_cast<int>(shapes_.size()) == num_outputs,
                ::tensorflow::errors::InvalidArgument("shapes must have N = ", num_outputs, " entries"));
    for (const auto& shape : shapes_) {
      OP_REQUIRES(ctx, shape.IsFullyDefined(),
                  ::tensorflow::errors::InvalidArgument("shapes must be fully defined, got ", shape.DebugString()));
    }
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shares", &num_shares_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_keys", &num_keys_));
    // Two parts (two shares, or a share and its blind key), or one part that is the sum already (an owner in
    // service mode unmasks and checks its answer in the call: `sum_check.SumCheck.verify`): then it only decodes.
    OP_REQUIRES(ctx, num_shares_ + num_keys_ == 2 || (num_shares_ == 1 && num_keys_ == 0),
                ::tensorflow::errors::InvalidArgument("a sum is revealed from two parts (two shares, or a "
                                                      "share and a key) or decoded from one revealed part, got ",
                                                      num_shares_, " shares and ", num_keys_, " keys"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const int words = ring_bits_ == 128 ? 2 : 1;  // 64-bit words per element (32-bit ring: 2 elements per word)
    const int per_word = ring_bits_ == 32 ? 2 : 1;
    const Tensor* b = num_shares_ == 2 ? &ctx->input(1) : nullptr;
    OP_REQUIRES(ctx, a.NumElements() % words == 0 && (b == nullptr || a.shape() == b->shape()),
                ::tensorflow::errors::InvalidArgument("the two shares differ in shape: ", a.shape().DebugString(),
                                                      " vs ", b == nullptr ? "-" : b->shape().DebugString()));
    const uint8_t* key = nullptr;
    if (num_keys_ == 1) {
      const Tensor& k = ctx->input(num_shares_);
      OP_REQUIRES(ctx, k.NumElements() == kSeedWords,
                  ::tensorflow::errors::InvalidArgument("the blind key must have 4 int32, got shape ",
                                                        k.shape().DebugString()));
      key = reinterpret_cast<const uint8_t*>(k.flat<int32_t>().data());
    }
    const int64_t total_words = a.NumElements();
    OP_REQUIRES(ctx, ring_bits_ != 32 || !shapes_.empty(),
                ::tensorflow::errors::InvalidArgument("the 32-bit ring needs the output shapes"));
    int64_t n = total_words / words;
    if (ring_bits_ == 32) {
      n = 0;
      for (const auto& shape : shapes_) n += shape.num_elements();
      OP_REQUIRES(ctx, RingWords(n, 32) == total_words,
                  ::tensorflow::errors::InvalidArgument("shapes hold ", n, " elements, the shares ",
                                                        total_words, " words of the 32-bit ring"));
    }
    Segments segments;
    std::vector<T*> outputs;
    ::tensorflow::OpOutputList out_list;
    OP_REQUIRES_OK(ctx, ctx->output_list("values", &out_list));
    for (size_t k = 0; k < std::max<size_t>(shapes_.size(), 1); ++k) {
      TensorShape shape({n});
      if (!shapes_.empty()) shapes_[k].AsTensorShape(&shape);
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, out_list.allocate(k, shape, &out));
      segments.Add(shape.num_elements());
      outputs.push_back(out->flat<T>().data());
    }
    OP_REQUIRES(ctx, segments.total() == n,
                ::tensorflow::errors::InvalidArgument("shapes hold ", segments.total(), " elements, the sum ", n));
    const uint8_t* pa = reinterpret_cast<const uint8_t*>(a.flat<int64_t>().data());
    const uint8_t* pb_all = b == nullptr ? nullptr : reinterpret_cast<const uint8_t*>(b->flat<int64_t>().data());
    const double factor = std::ldexp(1.0 / divisor_, -fraction_bits_);
    const int64_t chunks = NumChunks(total_words, 1);
    std::vector<uint8_t> overflow(chunks, 0), failed(chunks, 0);
    ForEachChunk(ctx, total_words, 1, [&](int64_t c, int64_t first_word, int64_t word_count) {
      const int64_t first = first_word * per_word / words;
      const int64_t count = std::min(word_count * per_word / words, n - first);
      // The second part: the other share, or the blind key's keystream for this chunk
      // (element i of the sum is element i - b_first of pb).
      std::unique_ptr<uint8_t[]> stream;
      const uint8_t* pb = pb_all;  // null: one part, the revealed sum itself (its second part is 0)
      int64_t b_first = 0;
      if (key != nullptr) {
        stream.reset(new uint8_t[word_count * 8]);
        if (!AesCtrKeystream(key, 0, first_word / kWordsPerBlock, stream.get(), word_count * 8)) {
          failed[c] = 1;
          return;
        }
        pb = stream.get();
        b_first = first;
      }
      segments.ForSegments(first, count, [&](int64_t k, int64_t begin, int64_t at, int64_t len) {
        T* y = outputs[k] + begin;
        const int64_t from = first + at;  // index of y[0] in the shares
        if (ring_bits_ == 32) {
          const uint32_t* x = reinterpret_cast<const uint32_t*>(pa) + from;
          const uint32_t* z = pb == nullptr ? nullptr : reinterpret_cast<const uint32_t*>(pb) + (from - b_first);
          for (int64_t i = 0; i < len; ++i) {
            const int32_t s = static_cast<int32_t>(x[i] + (z == nullptr ? 0u : z[i]));
            if (std::is_floating_point<T>::value) {
              y[i] = static_cast<T>(static_cast<double>(s) * factor);
            } else {
              y[i] = static_cast<T>(s);  // every int32 fits T (int32 or int64)
            }
          }
          return;
        }
        if (words == 1) {  // 64-bit ring: int64 arithmetic only (no __int128 conversions)
          const uint64_t* x = reinterpret_cast<const uint64_t*>(pa) + from;
          const uint64_t* z = pb == nullptr ? nullptr : reinterpret_cast<const uint64_t*>(pb) + (from - b_first);
          for (int64_t i = 0; i < len; ++i) {
            const int64_t s = static_cast<int64_t>(x[i] + (z == nullptr ? 0u : z[i]));
            if (std::is_floating_point<T>::value) {
              y[i] = static_cast<T>(static_cast<double>(s) * factor);
            } else if (s < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
                       s > static_cast<int64_t>(std::numeric_limits<T>::max())) {
              overflow[c] = 1;
            } else {
              y[i] = static_cast<T>(s);
            }
          }
          return;
        }
        for (int64_t i = 0; i < len; ++i) {
          u128 x, z = 0;
          std::memcpy(&x, pa + (from + i) * 16, 16);
          if (pb != nullptr) std::memcpy(&z, pb + (from - b_first + i) * 16, 16);
          const i128 s = static_cast<i128>(x + z);
          if (std::is_floating_point<T>::value) {
            y[i] = static_cast<T>(static_cast<double>(s) * factor);
          } else if (s < static_cast<i128>(std::numeric_limits<T>::min()) ||
                     s > static_cast<i128>(std::numeric_limits<T>::max())) {
            overflow[c] = 1;
          } else {
            y[i] = static_cast<T>(s);
          }
        }
      });
    });
    for (uint8_t f : failed) OP_REQUIRES(ctx, !f, ::tensorflow::errors::Internal("AES-128-CTR failed"));
    for (uint8_t o : overflow) {
      OP_REQUIRES(ctx, !o,
                  ::tensorflow::errors::InvalidArgument(
                      "Secure aggregation: a sum of integer values does not fit ",
                      ::tensorflow::DataTypeString(::tensorflow::DataTypeToEnum<T>::value),
                      "; keep counters smaller or use a wider integer type."));
    }
  }

 private:
  int ring_bits_;
  int fraction_bits_;
  std::vector<::tensorflow::PartialTensorShape> shapes_;
  int divisor_;
  int num_shares_;
  int num_keys_;
};

#define REGISTER_REVEAL(T) \
  REGISTER_KERNEL_BUILDER(Name("TfeRevealSum").Device(DEVICE_CPU).TypeConstraint<T>("T"), RevealSumOp<T>);
REGISTER_REVEAL(float)
REGISTER_REVEAL(double)
REGISTER_REVEAL(int32_t)
REGISTER_REVEAL(int64_t)
#undef REGISTER_REVEAL

}  // namespace
}  // namespace tfe_estimator
