// The owner's pass over a ring vector for the integrity checks of a service
// sum (tfe_estimator/distribute/sum_check.py): one C function that Python
// calls through ctypes (tfe_estimator/secure/kernels/check_pass.py), so the
// checks cost one cache-resident pass instead of five NumPy passes over
// multi-megabyte arrays.
//
// Per element i of a ring vector (the layout of secure_sum_ops.cc and
// service/ring.py: 32-bit lanes, 64-bit words, or (low, high) word pairs):
//
//   plain_i = in_i + AES(mask_key)_i      (in_i = 0 for i >= in_elements)
//   out_i   = copy && i < in_elements ? in_i : plain_i
//
// or, for the first elements of a revealed sum (!copy), instead of out_i its
// decoding float(double(signed(plain_i)) * factor) (TfeRevealSum's) into the
// caller's float or double arrays: unmasked, checked and decoded in one pass;
// and, over the first n elements, per check row m the exact integer
// sum_i r_mi * signed(plain_i) with the coefficients
// r_mi = (u32 keystream word m*n + i of coefficient_key) >> 12, the
// coefficients of `SumCheck.coefficients`. The sums are exact in 128-bit
// integers: per row A (sum of r * signed(x), or of r * signed(high word) on
// the 128-bit ring) and B (0, or sum of r * low word on the 128-bit ring); the
// row's value is A * 2**64 + B on the 128-bit ring, else A. Every keystream is
// BoringSSL's AES-128-CTR from counter 0 (aes_ctr.h); nothing here is a cipher.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "aes_ctr.h"

namespace tfe_estimator {
namespace {

constexpr int kRows = 2;
constexpr int kCoefficientShift = 32 - 20;
// Elements per block: cache-sized; at most 4096 (the 64-bit ring's products sum exactly in 64-bit lanes).
constexpr int64_t kPassElements = 4096;

using Int128 = __int128;
using UInt128 = unsigned __int128;

struct Sums {
  Int128 a[kRows] = {0, 0};
  UInt128 b[kRows] = {0, 0};
};

// One AES-128-CTR keystream (aes_ctr.h's convention: counter block 0 is the big-endian 0) read in order from any
// byte on, through one cipher context for the whole pass: a key is expanded once per pass, not once per block.
class Stream {
 public:
  Stream() : ctx_(EVP_CIPHER_CTX_new()) {}
  ~Stream() {
    if (ctx_ != nullptr) EVP_CIPHER_CTX_free(ctx_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Positions the stream of `key` at keystream byte `offset`.
  TFE_MUST_CHECK bool Start(const uint8_t* key, uint64_t offset) {
    if (ctx_ == nullptr) return false;
    uint8_t iv[kBlockBytes];
    CounterBlock(0, offset / kBlockBytes, iv);
    if (EVP_EncryptInit_ex(ctx_, EVP_aes_128_ctr(), nullptr, key, iv) != 1) return false;
    uint8_t skipped[kBlockBytes];
    return offset % kBlockBytes == 0 || Next(skipped, offset % kBlockBytes);
  }

  // The next `n` keystream bytes (n <= kZeroBytes) into `out`.
  TFE_MUST_CHECK bool Next(uint8_t* out, size_t n) {
    int written = 0;
    return EVP_EncryptUpdate(ctx_, out, &written, kZeros, static_cast<int>(n)) == 1 &&
           written == static_cast<int>(n);
  }

  static constexpr size_t kZeroBytes = 16 * kPassElements;  // a block of the widest ring (128-bit elements)

 private:
  static const uint8_t kZeros[kZeroBytes];
  EVP_CIPHER_CTX* ctx_;
};
const uint8_t Stream::kZeros[Stream::kZeroBytes] = {};

// The pass over elements [s, s + count) of one ring: T is the element's word type (uint32_t, uint64_t) or, for
// the 128-bit ring, `Pair`.
struct Pair {
  uint64_t low, high;
};

inline void Add(uint32_t& x, uint32_t y) { x += y; }
inline void Add(uint64_t& x, uint64_t y) { x += y; }
inline void Add(Pair& x, Pair y) {
  x.low += y.low;
  x.high += y.high + (x.low < y.low ? 1 : 0);
}

inline void Accumulate(uint32_t x, uint32_t r, int row, Sums* sums) {
  sums->a[row] += static_cast<int64_t>(static_cast<int32_t>(x)) * static_cast<int64_t>(r);
}
inline void Accumulate(uint64_t x, uint32_t r, int row, Sums* sums) {
  sums->a[row] += static_cast<Int128>(static_cast<int64_t>(x)) * r;
}
inline void Accumulate(Pair x, uint32_t r, int row, Sums* sums) {
  sums->a[row] += static_cast<Int128>(static_cast<int64_t>(x.high)) * r;
  sums->b[row] += static_cast<UInt128>(x.low) * r;
}

// Adds, per row, sum_i c_i * signed(x_i) over one block (count <= kPassElements) to `sums`, with c_i the raw
// coefficient word raw[row][i] shifted to its 20 bits, exactly.
template <typename T>
inline void BlockDot(const T* x, const uint32_t* const raw[kRows], int64_t count, Sums* sums) {
  for (int row = 0; row < kRows; ++row) {
    for (int64_t i = 0; i < count; ++i) Accumulate(x[i], raw[row][i] >> kCoefficientShift, row, sums);
  }
}

#if defined(__SSE2__)
// The 64-bit ring's products, 2.4x faster than the 128-bit multiply-adds above (the owner's check passes ran at
// 6x the AES floor): with x = high * 2**32 + low (32-bit halves) and signed(x) = x - 2**64 [top bit of x],
// sum_i c_i signed(x_i) = L + 2**32 H - 2**64 G with L = sum c_i low_i, H = sum c_i high_i, G = sum of c_i over the
// negative x_i. Each product of a coefficient (c < 2**20) and a 32-bit half is below 2**52, so a block's 4096 of
// them sum below 2**64: L, H and G are exact in unsigned 64-bit lanes of SSE2's 32 x 32 -> 64-bit multiply
// (every x86-64 CPU has it), folded into 128 bits once per block.
static_assert(kPassElements <= 4096, "a block's sums of 52-bit products stay below 2**64 (and, on the 32-bit ring, "
                                    "its sums of coefficients below 2**32)");

struct Lanes {
  __m128i low = _mm_setzero_si128(), high = _mm_setzero_si128(), negative = _mm_setzero_si128();
};

// Four elements of one row: x01, x23 their words, h the high halves, s all-ones lanes where x is negative.
inline void Dot4(__m128i x01, __m128i x23, __m128i h01, __m128i h23, __m128i s01, __m128i s23, const uint32_t* raw,
                 Lanes* lanes) {
  const __m128i zero = _mm_setzero_si128();
  const __m128i c = _mm_srli_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw)), kCoefficientShift);
  const __m128i c01 = _mm_unpacklo_epi32(c, zero), c23 = _mm_unpackhi_epi32(c, zero);
  lanes->low = _mm_add_epi64(lanes->low, _mm_add_epi64(_mm_mul_epu32(x01, c01), _mm_mul_epu32(x23, c23)));
  lanes->high = _mm_add_epi64(lanes->high, _mm_add_epi64(_mm_mul_epu32(h01, c01), _mm_mul_epu32(h23, c23)));
  lanes->negative = _mm_add_epi64(lanes->negative, _mm_add_epi64(_mm_and_si128(s01, c01), _mm_and_si128(s23, c23)));
}

inline uint64_t LaneSum(__m128i v) {
  uint64_t lane[2];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lane), v);
  return lane[0] + lane[1];
}

template <>
inline void BlockDot<uint64_t>(const uint64_t* x, const uint32_t* const raw[kRows], int64_t count, Sums* sums) {
  Lanes lanes[kRows];
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const __m128i x01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m128i x23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 2));
    const __m128i h01 = _mm_srli_epi64(x01, 32), h23 = _mm_srli_epi64(x23, 32);
    // the sign bit of each 64-bit lane spread over it: the high dword's arithmetic shift, copied to the low one
    const __m128i s01 = _mm_shuffle_epi32(_mm_srai_epi32(x01, 31), 0xF5);
    const __m128i s23 = _mm_shuffle_epi32(_mm_srai_epi32(x23, 31), 0xF5);
    for (int row = 0; row < kRows; ++row) Dot4(x01, x23, h01, h23, s01, s23, raw[row] + i, &lanes[row]);
  }
  for (int row = 0; row < kRows; ++row) {
    uint64_t low = LaneSum(lanes[row].low), high = LaneSum(lanes[row].high);
    uint64_t negative = LaneSum(lanes[row].negative);
    for (int64_t j = i; j < count; ++j) {
      const uint64_t c = raw[row][j] >> kCoefficientShift;
      low += (x[j] & 0xFFFFFFFFu) * c;
      high += (x[j] >> 32) * c;
      negative += (x[j] >> 63) * c;
    }
    sums->a[row] += static_cast<Int128>(low) + (static_cast<Int128>(high) << 32) -
                    (static_cast<Int128>(negative) << 64);
  }
}
// The 32-bit ring's products, in SSE2 lanes like the 64-bit ones (the scalar loop above cost the 32-bit ring's
// passes more than their two keystreams): with x the element's 32-bit word and signed(x) = x - 2**32 [top bit of
// x], sum_i c_i signed(x_i) = L - 2**32 G with L = sum c_i x_i and G = sum of c_i over the negative x_i. Each
// product of a coefficient (c < 2**20) and a word is below 2**52, so a block's 4096 of them sum below 2**64: L is
// exact in unsigned 64-bit lanes of SSE2's 32 x 32 -> 64-bit multiply (even lanes, then odd lanes shifted down);
// a block's G is below 4096 * 2**20 = 2**32, exact in 32-bit lanes (each holds a quarter of them).
template <>
inline void BlockDot<uint32_t>(const uint32_t* x, const uint32_t* const raw[kRows], int64_t count, Sums* sums) {
  __m128i low[kRows], negative[kRows];
  for (int row = 0; row < kRows; ++row) low[row] = negative[row] = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const __m128i x0123 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m128i x13 = _mm_srli_epi64(x0123, 32);  // the odd words in the even lanes
    const __m128i s = _mm_srai_epi32(x0123, 31);     // all-ones lanes where x is negative
    for (int row = 0; row < kRows; ++row) {
      const __m128i c =
          _mm_srli_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw[row] + i)), kCoefficientShift);
      const __m128i c13 = _mm_srli_epi64(c, 32);
      low[row] = _mm_add_epi64(low[row], _mm_add_epi64(_mm_mul_epu32(x0123, c), _mm_mul_epu32(x13, c13)));
      negative[row] = _mm_add_epi32(negative[row], _mm_and_si128(s, c));
    }
  }
  for (int row = 0; row < kRows; ++row) {
    uint64_t sum = LaneSum(low[row]);
    uint32_t lane[4];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lane), negative[row]);
    uint64_t negatives = uint64_t{lane[0]} + lane[1] + lane[2] + lane[3];
    for (int64_t j = i; j < count; ++j) {
      const uint64_t c = raw[row][j] >> kCoefficientShift;
      sum += uint64_t{x[j]} * c;
      negatives += (x[j] >> 31) * c;
    }
    sums->a[row] += static_cast<Int128>(sum) - (static_cast<Int128>(negatives) << 32);
  }
}
#endif

inline double Signed(uint32_t x) { return static_cast<double>(static_cast<int32_t>(x)); }
inline double Signed(uint64_t x) { return static_cast<double>(static_cast<int64_t>(x)); }
inline double Signed(Pair x) {
  return static_cast<double>(static_cast<Int128>((static_cast<UInt128>(x.high) << 64) | x.low));
}

// The decoding of a revealed sum's first `elements` elements (secure_sum_ops.cc's TfeRevealSum of one part:
// float(double(signed(x)) * factor), the same roundings) into its output arrays of float (type 1) or double
// (type 2), `sizes[k]` elements each, in order (the sizes sum to `elements`: checked by tfe_sum_check_pass).
struct Decode {
  int type = 0;  // 0: nothing decoded
  int64_t elements = 0;
  double factor = 1.0;
  void* const* outputs = nullptr;
  const int64_t* sizes = nullptr;
  int64_t array = 0, at = 0;  // the next element's output array and index in it

  template <typename T, typename Out>
  void Into(const T* plain, int64_t n) {
    for (int64_t i = 0; i < n;) {
      while (at == sizes[array]) ++array, at = 0;
      const int64_t run = std::min(n - i, sizes[array] - at);
      Out* y = static_cast<Out*>(outputs[array]) + at;
      for (int64_t j = 0; j < run; ++j) y[j] = static_cast<Out>(Signed(plain[i + j]) * factor);
      i += run;
      at += run;
    }
  }

  template <typename T>
  void Next(const T* plain, int64_t n) {
    if (type == 1) Into<T, float>(plain, n);
    if (type == 2) Into<T, double>(plain, n);
  }
};

template <typename T>
int Pass(const T* in, int64_t in_elements, int64_t total, int64_t n, const uint8_t* mask_key,
         const uint8_t* coefficient_key, bool copy, T* out, Sums* sums, Decode* decode) {
  static_assert(sizeof(T) * kPassElements <= Stream::kZeroBytes, "a block's keystream is read from zeros");
  std::vector<T> plain(kPassElements);
  std::vector<uint32_t> coefficients[kRows];
  Stream mask, rows[kRows];
  if (!mask.Start(mask_key, 0)) return -1;
  for (int row = 0; row < kRows; ++row) {
    coefficients[row].resize(kPassElements);
    // row m's coefficient of element i is u32 keystream word m * n + i
    if (n > 0 && !rows[row].Start(coefficient_key, 4 * static_cast<uint64_t>(row) * n)) return -1;
  }
  const uint32_t* const raw[kRows] = {coefficients[0].data(), coefficients[1].data()};
  for (int64_t s = 0; s < total; s += kPassElements) {
    const int64_t count = std::min(kPassElements, total - s);
    if (!mask.Next(reinterpret_cast<uint8_t*>(plain.data()), count * sizeof(T))) return -1;
    const int64_t given = std::max<int64_t>(0, std::min(count, in_elements - s));
    for (int64_t i = 0; i < given; ++i) Add(plain[i], in[s + i]);
    if (copy) {
      std::memcpy(out + s, in + s, given * sizeof(T));
      std::memcpy(out + s + given, plain.data() + given, (count - given) * sizeof(T));
    } else {
      // the decoded elements are not written as words
      const int64_t decoded = std::max<int64_t>(0, std::min(count, decode->elements - s));
      if (decoded > 0) decode->Next(plain.data(), decoded);
      std::memcpy(out + s + decoded, plain.data() + decoded, (count - decoded) * sizeof(T));
    }
    const int64_t checked = std::max<int64_t>(0, std::min(count, n - s));
    if (checked == 0) continue;
    for (int row = 0; row < kRows; ++row) {
      if (!rows[row].Next(reinterpret_cast<uint8_t*>(coefficients[row].data()), 4 * checked)) return -1;
    }
    BlockDot(plain.data(), raw, checked, sums);
  }
  return 0;
}

}  // namespace
}  // namespace tfe_estimator

// Returns 0, -1 if the cipher library reported an error, -2 for arguments outside the contract.
//   in: in_elements elements; out: total elements (the 32-bit ring's padding lane of an odd total is set to 0);
//   0 <= n <= in_elements <= total (or n <= total when !copy); sums: kRows * 4 int64, per row the little-endian
//   words of A (signed) then of B (unsigned).
//   decoded_type 0: nothing decoded; 1 (float) or 2 (double), only when !copy: the first decoded_elements
//   elements are decoded into the num_decoded arrays decoded[k] of decoded_sizes[k] elements (summing to
//   decoded_elements <= total) and not written to out.
extern "C" __attribute__((visibility("default"))) int tfe_sum_check_pass(
    const void* in, int64_t in_elements, int64_t total, int64_t n, int ring_bits, const uint8_t* mask_key,
    const uint8_t* coefficient_key, int copy, void* out, int64_t* sums_out, int decoded_type,
    int64_t decoded_elements, double factor, void* const* decoded, const int64_t* decoded_sizes,
    int64_t num_decoded) {
  using namespace tfe_estimator;  // NOLINT
  if (in_elements < 0 || total < in_elements || n < 0 || n > total || n > (int64_t{1} << 40)) return -2;
  Decode decode;
  if (decoded_type != 0) {
    int64_t sizes = 0;
    for (int64_t k = 0; k < num_decoded; ++k) {
      if (decoded_sizes[k] < 0 || decoded[k] == nullptr) return -2;
      sizes += decoded_sizes[k];
    }
    if ((decoded_type != 1 && decoded_type != 2) || copy != 0 || decoded_elements < 0 ||
        decoded_elements > total || sizes != decoded_elements) {
      return -2;
    }
    decode.type = decoded_type;
    decode.elements = decoded_elements;
    decode.factor = factor;
    decode.outputs = decoded;
    decode.sizes = decoded_sizes;
  }
  Sums sums;
  int status = -2;
  if (ring_bits == 32) {
    status = Pass(static_cast<const uint32_t*>(in), in_elements, total, n, mask_key, coefficient_key, copy != 0,
                  static_cast<uint32_t*>(out), &sums, &decode);
    if (status == 0 && total % 2 == 1) static_cast<uint32_t*>(out)[total] = 0;
  } else if (ring_bits == 64) {
    status = Pass(static_cast<const uint64_t*>(in), in_elements, total, n, mask_key, coefficient_key, copy != 0,
                  static_cast<uint64_t*>(out), &sums, &decode);
  } else if (ring_bits == 128) {
    status = Pass(static_cast<const Pair*>(in), in_elements, total, n, mask_key, coefficient_key, copy != 0,
                  static_cast<Pair*>(out), &sums, &decode);
  }
  if (status != 0) return status;
  for (int row = 0; row < kRows; ++row) {
    const UInt128 a = static_cast<UInt128>(sums.a[row]);
    sums_out[4 * row + 0] = static_cast<int64_t>(static_cast<uint64_t>(a));
    sums_out[4 * row + 1] = static_cast<int64_t>(static_cast<uint64_t>(a >> 64));
    sums_out[4 * row + 2] = static_cast<int64_t>(static_cast<uint64_t>(sums.b[row]));
    sums_out[4 * row + 3] = static_cast<int64_t>(static_cast<uint64_t>(sums.b[row] >> 64));
  }
  return 0;
}
