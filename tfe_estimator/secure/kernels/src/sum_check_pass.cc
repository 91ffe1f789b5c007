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

#include "aes_ctr.h"

namespace tfe_estimator {
namespace {

constexpr int kRows = 2;
constexpr int kCoefficientShift = 32 - 20;
// Elements per block: a multiple of 4, so every block's keystream starts on an AES block in every ring.
constexpr int64_t kPassElements = 4096;

using Int128 = __int128;
using UInt128 = unsigned __int128;

struct Sums {
  Int128 a[kRows] = {0, 0};
  UInt128 b[kRows] = {0, 0};
};

// `count` u32 coefficients of `key` from u32 word `first` on, shifted to 20 bits, into `out` (`scratch` has
// room for count + 4 words).
bool Coefficients(const uint8_t* key, int64_t first, int64_t count, uint32_t* scratch, const uint32_t** out) {
  const int64_t byte = 4 * first;
  const int64_t skip = (byte % kBlockBytes) / 4;
  if (!AesCtrKeystream(key, 0, byte / kBlockBytes, reinterpret_cast<uint8_t*>(scratch), 4 * (count + skip))) {
    return false;
  }
  for (int64_t i = skip; i < skip + count; ++i) scratch[i] >>= kCoefficientShift;
  *out = scratch + skip;
  return true;
}

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

template <typename T>
int Pass(const T* in, int64_t in_elements, int64_t total, int64_t n, const uint8_t* mask_key,
         const uint8_t* coefficient_key, bool copy, T* out, Sums* sums) {
  std::vector<T> plain(kPassElements);
  std::vector<uint32_t> coefficient_scratch[kRows];
  for (auto& c : coefficient_scratch) c.resize(kPassElements + 4);
  for (int64_t s = 0; s < total; s += kPassElements) {
    const int64_t count = std::min(kPassElements, total - s);
    if (!AesCtrKeystream(mask_key, 0, s * sizeof(T) / kBlockBytes, reinterpret_cast<uint8_t*>(plain.data()),
                         count * sizeof(T))) {
      return -1;
    }
    const int64_t given = std::max<int64_t>(0, std::min(count, in_elements - s));
    for (int64_t i = 0; i < given; ++i) Add(plain[i], in[s + i]);
    if (copy) {
      std::memcpy(out + s, in + s, given * sizeof(T));
      std::memcpy(out + s + given, plain.data() + given, (count - given) * sizeof(T));
    } else {
      std::memcpy(out + s, plain.data(), count * sizeof(T));
    }
    const int64_t checked = std::max<int64_t>(0, std::min(count, n - s));
    for (int row = 0; row < kRows && checked > 0; ++row) {
      const uint32_t* r = nullptr;
      if (!Coefficients(coefficient_key, row * n + s, checked, coefficient_scratch[row].data(), &r)) return -1;
      for (int64_t i = 0; i < checked; ++i) Accumulate(plain[i], r[i], row, sums);
    }
  }
  return 0;
}

}  // namespace
}  // namespace tfe_estimator

// Returns 0, -1 if the cipher library reported an error, -2 for arguments outside the contract.
//   in: in_elements elements; out: total elements (the 32-bit ring's padding lane of an odd total is set to 0);
//   0 <= n <= in_elements <= total (or n <= total when !copy); sums: kRows * 4 int64, per row the little-endian
//   words of A (signed) then of B (unsigned).
extern "C" __attribute__((visibility("default"))) int tfe_sum_check_pass(
    const void* in, int64_t in_elements, int64_t total, int64_t n, int ring_bits, const uint8_t* mask_key,
    const uint8_t* coefficient_key, int copy, void* out, int64_t* sums_out) {
  using namespace tfe_estimator;  // NOLINT
  if (in_elements < 0 || total < in_elements || n < 0 || n > total || n > (int64_t{1} << 40)) return -2;
  Sums sums;
  int status = -2;
  if (ring_bits == 32) {
    status = Pass(static_cast<const uint32_t*>(in), in_elements, total, n, mask_key, coefficient_key, copy != 0,
                  static_cast<uint32_t*>(out), &sums);
    if (status == 0 && total % 2 == 1) static_cast<uint32_t*>(out)[total] = 0;
  } else if (ring_bits == 64) {
    status = Pass(static_cast<const uint64_t*>(in), in_elements, total, n, mask_key, coefficient_key, copy != 0,
                  static_cast<uint64_t*>(out), &sums);
  } else if (ring_bits == 128) {
    status = Pass(static_cast<const Pair*>(in), in_elements, total, n, mask_key, coefficient_key, copy != 0,
                  static_cast<Pair*>(out), &sums);
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
