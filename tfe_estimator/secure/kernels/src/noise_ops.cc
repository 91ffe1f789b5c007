// Exact discrete Gaussian noise for distributed differential privacy.
//
//   noise = TfeDiscreteGaussian(shape, variance)
//
// Each element is an independent sample of the discrete Gaussian N_Z(0, v),
// Pr[X = x] proportional to exp(-x^2 / (2 v)) on the integers, for an integer
// v = `variance` in [1, 2^100]. The sampler is Karney's exact algorithm D
// ("Sampling exactly from the normal distribution", ACM TOMS 2016) for the
// discrete Gaussian with mu = 0 and sigma = sqrt(v); no floating point decides
// a sample (Mironov, CCS 2012):
//
//   1. k >= 0 with Pr ~ exp(-k^2 / 2): one uniform U falls in a region of a
//      table of exact boundaries (k = 0..3, a tail region for k >= 4 drawn by
//      Bernoulli(exp(-1/2)) trials, or a rejected part; "k table" below);
//   2. a sign s and j uniform on [0, ceil(sigma)); m = ceil(k sigma) + j,
//      rejected if m >= ceil((k + 1) sigma) (so every m >= 0 belongs to one k)
//      or if m = 0 and s < 0 (0 counted once);
//   3. accept with probability exp(-(m^2 - k^2 v) / (2 v)) and return s m.
//
// Every m >= 0 is then output with probability proportional to
// exp(-k^2/2) exp(-(m^2 - k^2 v) / (2 v)) = exp(-m^2 / (2 v)). Each random
// decision compares a uniform real U, drawn 32 or 64 bits at a time, with a
// real y (a region boundary, or exp(-x) for rational x): bounds on y decide
// from U's first bits almost always (double precision with a margin above
// its rounding error, or integer bounds computed once), and otherwise an
// interval of y in multi-precision integer arithmetic, narrowed until it
// separates y from U, decides exactly. A sample costs about 1.4 tries of
// steps 1-3 and about 3 words of keystream.
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
#include <atomic>
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

  // A whole 64-bit word (the next 64 bits of a uniform real in [0, 1)).
  uint64_t Word() { return words_.Next(); }

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

  // Uniform on [0, c), 1 <= c <= 2^62, from the 63-bit uniform `first` (and
  // more words if rejected): Lemire's multiply-and-reject ("Fast random
  // integer generation in an interval", 2019) over 2^63, exactly uniform.
  uint64_t Below63(uint64_t c, uint64_t first) {
    constexpr uint64_t kMask = (1ull << 63) - 1;
    u128 m = static_cast<u128>(first) * c;
    if ((static_cast<uint64_t>(m) & kMask) < c) {
      const uint64_t threshold = ((1ull << 63) - c) % c;  // 2^63 mod c
      while ((static_cast<uint64_t>(m) & kMask) < threshold) m = static_cast<u128>(words_.Next() >> 1) * c;
    }
    return static_cast<uint64_t>(m >> 63);
  }

  // Uniform on [0, c), 1 <= c < 2^64: Lemire's multiply-and-reject ("Fast
  // random integer generation in an interval", 2019), exactly uniform.
  uint64_t Below(uint64_t c) {
    u128 m = static_cast<u128>(words_.Next()) * c;
    if (static_cast<uint64_t>(m) < c) {
      const uint64_t threshold = (0 - c) % c;  // 2^64 mod c
      while (static_cast<uint64_t>(m) < threshold) m = static_cast<u128>(words_.Next()) * c;
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  AesWords words_;
  uint64_t pool_ = 0;
  int count_ = 0;
};

// ------------------------------------------------- exact Bernoulli(exp) --
//
// Bernoulli(exp(-a/b)) is decided as U < exp(-a/b) for a uniform real U whose
// binary digits are drawn as needed. The first 32 bits w of U almost always
// decide it against bounds L <= exp(-a/b) <= H computed in double precision,
// widened by a margin (2^-40 by default) plus kDoubleError (2^-46), a rigorous
// bound on their rounding error (below 2^-48.7, shown at ExpBernoulli):
// w + 1 <= L 2^32 means U < exp(-a/b), w >= H 2^32 means U >= exp(-a/b).
// Otherwise (with probability about 2 * margin) the exact path draws more
// words of U and compares them with an interval of exp(-a/b) computed in
// multi-precision integer arithmetic (alternating Taylor series with
// floor/ceiling bounds) until the interval separates them. So the decision is
// exact: the double arithmetic only chooses which path decides, never the
// answer. The same exact comparison (LessExact) decides the k table's regions.

// Unsigned multi-precision integers, little-endian 64-bit limbs (exact path only).
using Big = std::vector<uint64_t>;

void Trim(Big& x) {
  while (!x.empty() && x.back() == 0) x.pop_back();
}

Big FromU128(u128 v) {
  Big x = {static_cast<uint64_t>(v), static_cast<uint64_t>(v >> 64)};
  Trim(x);
  return x;
}

int Compare(const Big& a, const Big& b) {
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  for (size_t i = a.size(); i-- > 0;) {
    if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
  }
  return 0;
}

Big Add(const Big& a, const Big& b) {
  Big r(std::max(a.size(), b.size()) + 1, 0);
  u128 carry = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    carry += static_cast<u128>(i < a.size() ? a[i] : 0) + (i < b.size() ? b[i] : 0);
    r[i] = static_cast<uint64_t>(carry);
    carry >>= 64;
  }
  Trim(r);
  return r;
}

Big Sub(const Big& a, const Big& b) {  // a - b for a >= b
  Big r(a.size(), 0);
  uint64_t borrow = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const uint64_t bi = i < b.size() ? b[i] : 0;
    const u128 d = static_cast<u128>(a[i]) - bi - borrow;
    r[i] = static_cast<uint64_t>(d);
    borrow = (d >> 64) ? 1 : 0;
  }
  Trim(r);
  return r;
}

Big Mul(const Big& a, const Big& b) {
  Big r(a.size() + b.size() + 1, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    u128 carry = 0;
    for (size_t j = 0; j < b.size(); ++j) {
      carry += static_cast<u128>(a[i]) * b[j] + r[i + j];
      r[i + j] = static_cast<uint64_t>(carry);
      carry >>= 64;
    }
    for (size_t k = i + b.size(); carry; ++k) {
      carry += r[k];
      r[k] = static_cast<uint64_t>(carry);
      carry >>= 64;
    }
  }
  Trim(r);
  return r;
}

// floor(x / 2^bits), or the ceiling when `ceil`.
Big ShiftRight(const Big& x, int bits, bool ceil) {
  const size_t limbs = bits / 64, rest = bits % 64;
  bool dropped = false;
  for (size_t i = 0; i < std::min(limbs, x.size()); ++i) dropped = dropped || x[i] != 0;
  if (limbs < x.size() && rest) dropped = dropped || (x[limbs] & ((1ull << rest) - 1)) != 0;
  Big r;
  for (size_t i = limbs; i < x.size(); ++i) {
    uint64_t v = x[i] >> rest;
    if (rest && i + 1 < x.size()) v |= x[i + 1] << (64 - rest);
    r.push_back(v);
  }
  Trim(r);
  return ceil && dropped ? Add(r, Big{1}) : r;
}

// floor(x / n), or the ceiling when `ceil`; n >= 1.
Big DivSmall(const Big& x, uint64_t n, bool ceil) {
  Big r(x.size(), 0);
  u128 rem = 0;
  for (size_t i = x.size(); i-- > 0;) {
    rem = (rem << 64) | x[i];
    r[i] = static_cast<uint64_t>(rem / n);
    rem %= n;
  }
  Trim(r);
  return ceil && rem ? Add(r, Big{1}) : r;
}

// [lo, hi] with lo <= 2^p exp(-a/b) <= hi, for 0 <= a <= b < 2^127.
void ExpInterval(u128 a, u128 b, int p, Big* lo, Big* hi) {
  const int g = p + 32;  // guard bits for the series' roundings
  // X = floor(2^g a / b) by long division, so X <= 2^g x < X + 1 for x = a/b.
  Big x_lo((g + 63) / 64 + 1, 0);
  u128 r = a;
  for (int bit = g - 1; bit >= 0; --bit) {
    r <<= 1;
    if (r >= b) r -= b, x_lo[bit / 64] |= 1ull << (bit % 64);
  }
  Trim(x_lo);
  const Big x_hi = Add(x_lo, Big{1});
  // t_n = 2^g x^n / n!, bracketed: t_lo[n] <= t_n <= t_hi[n]. The series is
  // alternating with non-increasing terms (x <= 1), so a partial sum ending on an
  // odd term is a lower bound and one ending on an even term an upper bound.
  Big one((g / 64) + 1, 0);
  one[g / 64] = 1ull << (g % 64);
  Big t_lo = one, t_hi = one, even_lo = one, even_hi = one, odd_lo, odd_hi, last_even_hi;
  for (uint64_t n = 1;; ++n) {
    t_lo = DivSmall(ShiftRight(Mul(t_lo, x_lo), g, false), n, false);
    t_hi = DivSmall(ShiftRight(Mul(t_hi, x_hi), g, true), n, true);
    if (n % 2 == 1) {
      odd_lo = Add(odd_lo, t_lo), odd_hi = Add(odd_hi, t_hi);
      if (Compare(t_hi, Big{1}) <= 0) {
        // Lower bound: sum to n (odd); upper bound: sum to n + 1, whose term is at most t_hi.
        const Big lower = Compare(even_lo, odd_hi) > 0 ? Sub(even_lo, odd_hi) : Big{};
        const Big upper = Sub(Add(even_hi, t_hi), odd_lo);
        *lo = ShiftRight(lower, g - p, false);
        *hi = ShiftRight(upper, g - p, true);
        return;
      }
    } else {
      even_lo = Add(even_lo, t_lo), even_hi = Add(even_hi, t_hi);
    }
  }
}

// U < y, exactly, for a uniform real U in [0, 1) and a real y in (0, 1) that is
// not a dyadic rational (every y here is exp(-x) for a rational x > 0 or a
// non-constant polynomial in exp(-1/2) with rational coefficients, so
// transcendental by Lindemann: the loop ends with probability 1). `digits` holds U's first 64-bit words, most significant
// first; more are drawn from `rng` and appended as needed, so several
// comparisons of one U see the same U. `bounds(P, &lo, &hi)` must give
// lo <= 2^P y <= hi with hi - lo bounded as P grows.
template <typename Bounds>
bool LessExact(RandomBits& rng, std::vector<uint64_t>* digits, const Bounds& bounds) {
  for (size_t words = 1;; words *= 2) {
    while (digits->size() < words) digits->push_back(rng.Word());
    Big u(words, 0);
    for (size_t i = 0; i < words; ++i) u[words - 1 - i] = (*digits)[i];
    Trim(u);
    Big lo, hi;
    bounds(static_cast<int>(64 * words), &lo, &hi);
    if (Compare(Add(u, Big{1}), lo) <= 0) return true;  // U < (u + 1) / 2^P <= y
    if (Compare(u, hi) >= 0) return false;              // U >= u / 2^P >= y
  }
}

// lo <= 2^g y^n <= hi from lo <= 2^g y <= hi (n >= 1): n - 1 products, each
// rounded outward (floor of the lower, ceiling of the upper bound), so the
// results stay bounds; for y <= 1 each rounding widens them by at most 1.
void PowerInterval(const Big& y_lo, const Big& y_hi, uint64_t n, int g, Big* lo, Big* hi) {
  *lo = y_lo, *hi = y_hi;
  for (uint64_t i = 1; i < n; ++i) {
    *lo = ShiftRight(Mul(*lo, y_lo), g, false);
    *hi = ShiftRight(Mul(*hi, y_hi), g, true);
  }
}

// [lo, hi] with lo <= 2^p exp(-q - r/b) <= hi, for q < 2^13 and 0 <= r < b < 2^127:
// exp(-r/b) times q factors exp(-1), with 48 guard bits for the ~3q outward
// roundings (so hi - lo stays a few units at any p, and the comparison ends).
void ExpIntervalQ(uint64_t q, u128 r, u128 b, int p, Big* lo, Big* hi) {
  const int g = p + 48;
  Big f_lo, f_hi;
  ExpInterval(r, b, g, &f_lo, &f_hi);
  if (q > 0) {
    Big e_lo, e_hi, eq_lo, eq_hi;
    ExpInterval(1, 1, g, &e_lo, &e_hi);
    PowerInterval(e_lo, e_hi, q, g, &eq_lo, &eq_hi);
    f_lo = ShiftRight(Mul(f_lo, eq_lo), g, false);
    f_hi = ShiftRight(Mul(f_hi, eq_hi), g, true);
  }
  *lo = ShiftRight(f_lo, g - p, false);
  *hi = ShiftRight(f_hi, g - p, true);
}

// x as a double, correctly rounded (the two 32-bit halves convert exactly;
// their sum rounds once), without the branch on the top bit that the
// compiler's unsigned conversion takes (a coin flip for random words).
inline double ToDouble(uint64_t x) {
  return static_cast<double>(static_cast<int64_t>(x >> 32)) * 4294967296.0 +
         static_cast<double>(static_cast<int64_t>(x & 0xffffffffull));
}

// x as a double, within a relative 3 * 2^-53 < 2^-51.4 (three roundings: each
// half's and the sum's, each of at most 2^-53 of a value <= x).
inline double ToDouble(u128 x) {
  return ToDouble(static_cast<uint64_t>(x >> 64)) * 18446744073709551616.0 +
         ToDouble(static_cast<uint64_t>(x));
}

// Big -> double, within a relative 2^-51.3 (the top two limbs, 2^-51.4; the
// rest only lowers the value by less than 2^-64 of it).
double BigToDouble(const Big& x) {
  if (x.empty()) return 0;
  if (x.size() == 1) return static_cast<double>(x[0]);
  const u128 top = (static_cast<u128>(x.back()) << 64) | x[x.size() - 2];
  return std::ldexp(ToDouble(top), static_cast<int>(64 * (x.size() - 2)));
}

// The first 32 bits w of U decide unless they fall next to the bounds; then
// the exact path continues with U's first 64 bits (32 more fresh bits).
// U < (w + 1) / 2^32 <= y if w + 1 <= y 2^32, and U >= w / 2^32 >= y if
// w >= y 2^32: compared in double, exactly (w + 1 <= 2^32 and the scaling by
// a power of two are exact), so the bounds are compared as computed.
constexpr int kFastBits = 32;
constexpr double kFastScale = 4294967296.0;  // 2^kFastBits

// A rigorous bound on the rounding error of the double-precision bounds below
// (each is shown below 2^-49 where it is computed), with 8x headroom. It is
// added to the caller's margin, so every margin gives bounds that hold.
constexpr double kDoubleError = 1.0 / (1ull << 46);

// Optional self-check (attr check_fast_paths, tests only): every decision the
// fast paths take is taken again by the exact path with the same U, and a
// disagreement is recorded here (the op then fails).
struct FastPathCheck {
  std::atomic<bool> disagreed{false};
};

// exp(-q) 2^32 for q = 0..kExpTable - 1 as doubles lo[q] <= exp(-q) 2^32 <= hi[q]
// (from intervals at 192 bits, converted within 2^-51.3 and then moved out by
// 2^-50 relative: the product's own rounding is 2^-53), and lo = 0, hi =
// hi[kExpTable - 1] at q = kExpTable, which bounds exp(-q) 2^32 for every
// q >= kExpTable. Computed once per process.
constexpr int kExpTable = 64;
struct ExpTable {
  double lo[kExpTable + 1], hi[kExpTable + 1];
  static const ExpTable& Get() {
    static const ExpTable table;
    return table;
  }

 private:
  ExpTable() {
    constexpr int g = 192;
    Big e_lo, e_hi, y_lo(g / 64 + 1, 0), y_hi;
    y_lo[g / 64] = 1, y_hi = y_lo;  // 2^g exp(0)
    ExpInterval(1, 1, g, &e_lo, &e_hi);
    for (int q = 0; q < kExpTable; ++q) {
      lo[q] = std::ldexp(BigToDouble(y_lo) * (1 - std::ldexp(1.0, -50)), kFastBits - g);
      hi[q] = std::ldexp(BigToDouble(y_hi) * (1 + std::ldexp(1.0, -50)), kFastBits - g);
      y_lo = ShiftRight(Mul(y_lo, e_lo), g, false);
      y_hi = ShiftRight(Mul(y_hi, e_hi), g, true);
    }
    lo[kExpTable] = 0, hi[kExpTable] = hi[kExpTable - 1];
  }
};

// Bernoulli(exp(-a/b)) for integers 0 <= a < 2^127 and 1 <= b < 2^102, with
// a/b < 2^13 (here b = 2v and a/b <= kMaxK + 1), decided as U < exp(-a/b).
//
// Fast path, from U's first 32 bits w and x, a double within a relative
// 9 * 2^-53 = 2^-49.8 of a/b (the caller's; KarneySampler::Try shows it):
// x = q + f with q = floor(x) (capped at kExpTable) and f in [0, 1), and e^-f
// between the Taylor polynomials
//   T3(f) = (1 - f) + f^2 (1/2 - f/6) <= e^-f <= T3(f) + f^4/24
// (Lagrange remainder e^-xi f^4/24 in [0, f^4/24]), so
//   lo[q] T3(f) <= exp(-x) 2^32 <= hi[q] (T3(f) + f^4/24)
// up to the rounding error: x's own error moves exp(-x) by at most
// x e^-x 2^-49.8 < 2^-51.2; T3 is within 7 roundings of values
// <= 1 (1/6, f/6, the difference, f^2, the product, 1 - f, the sum), the
// upper term within 4 more and the products with the table within 2: 13 *
// 2^-53 < 2^-49.2. In all below 2^-48.9 < kDoubleError (relative to 2^32, the
// scale of the table and of w). The band between the two bounds is f^4/24 wide
// (below 1 % on average), then std::exp (glibc: within 1 ulp, 2^-52, plus the
// 2^-52 of x) decides within kDoubleError + margin, and only then (with
// probability about 2 * margin) the exact path. So the double arithmetic only
// chooses which path decides, never the answer.
class ExpBernoulli {
 public:
  ExpBernoulli(u128 b, double margin, FastPathCheck* check)
      : b_(b), margin_(margin + kDoubleError), scaled_margin_(margin_ * kFastScale), table_(ExpTable::Get()),
        check_(check) {}

  // U < exp(-a/b) for U's first 32 bits w (more are drawn from `rng` if
  // needed) and x: a/b within a relative 2^-49.8 (see above); the integer a =
  // a_of() is computed only if the exact path runs. The outcome is not
  // branched on here (a coin flip for the branch predictor); only the rare
  // undecided case is.
  template <typename A>
  bool operator()(RandomBits& rng, uint64_t w, double x, const A& a_of) const {
    const double w_lo = static_cast<double>(static_cast<int64_t>(w)), w_hi = w_lo + 1;  // exact
    const int q = static_cast<int>(x);  // floor: 0 <= x < 2^13
    const double f = x - q;             // exact (a truncation's remainder), in [0, 1)
    const int i = std::min(q, kExpTable);  // e^-x <= e^-63 e^-f for q >= kExpTable: lo 0, hi e^-63
    const double f2 = f * f;
    const double t3 = (1 - f) + f2 * (0.5 - f * (1.0 / 6));
    const bool below = w_hi <= table_.lo[i] * t3 - scaled_margin_;
    const bool above = w_lo >= table_.hi[i] * (t3 + f2 * f2 * (1.0 / 24)) + scaled_margin_;
    if (__builtin_expect((below | above) && check_ == nullptr, 1)) return below;
    return Slow(rng, w, a_of, x, below | above, below);
  }

 private:
  // The band between the polynomial bounds: std::exp's bounds, then the exact path.
  template <typename A>
  bool Slow(RandomBits& rng, uint64_t w, const A& a_of, double x, bool decided, bool fast) const {
    if (!decided) {
      const double e = std::exp(-x) * kFastScale, w_lo = static_cast<double>(static_cast<int64_t>(w));
      fast = w_lo + 1 <= e - scaled_margin_;
      decided = fast || w_lo >= e + scaled_margin_;
      if (decided && check_ == nullptr) return fast;
    }
    const bool exact = Exact(rng, w, a_of());
    if (decided && fast != exact) check_->disagreed = true;
    return exact;
  }

  // U < exp(-q - r/b) with q = floor(a/b), r = a - q b, in integers.
  bool Exact(RandomBits& rng, uint64_t w, u128 a) const {
    if (a == 0) return true;  // exp(0) = 1 > U
    const uint64_t q = static_cast<uint64_t>(a / b_);
    const u128 r = a - q * b_;
    std::vector<uint64_t> digits = {(w << 32) | rng.Bits(32)};
    return LessExact(rng, &digits, [&](int p, Big* lo, Big* hi) { ExpIntervalQ(q, r, b_, p, lo, hi); });
  }

  u128 b_;
  double margin_;
  double scaled_margin_;  // margin_ 2^32 (exact)
  const ExpTable& table_;
  FastPathCheck* check_;
};

// Bernoulli(exp(-a/b)) for a constant a/b <= 1: its exact bounds at 2^-16,
// computed once; the first 16 bits of U decide unless they tie with them.
class ConstantExpBernoulli {
 public:
  ConstantExpBernoulli(u128 a, u128 b) : a_(a), b_(b) {
    Big lo, hi;
    ExpInterval(a, b, 16, &lo, &hi);
    lo_ = lo.empty() ? 0 : lo[0];
    hi_ = hi.empty() ? 0 : hi[0];
  }

  bool operator()(RandomBits& rng) const {
    const uint64_t w = rng.Bits(16);
    if (w + 1 <= lo_) return true;
    if (w >= hi_) return false;
    std::vector<uint64_t> digits = {(w << 48) | rng.Bits(48)};
    return LessExact(rng, &digits, [&](int p, Big* lo, Big* hi) { ExpInterval(a_, b_, p, lo, hi); });
  }

 private:
  u128 a_, b_;
  uint64_t lo_, hi_;
};

// ---------------------------------------------------------------- k table --
//
// Karney's step 1 wants k >= 0 with Pr[k] proportional to exp(-k^2/2) = p^(k^2),
// p = exp(-1/2). The loop of the header draws it as (1 - p) p^k p^(k(k-1)) and
// rejects the rest (31 %), at about 2.5 unpredictable Bernoulli(p) per try.
// Instead one uniform U in [0, 1) falls in one of the regions
//
//   k = 0, 1, 2, 3:  [B_k, B_(k+1)), of length c p^(k^2), c = R (1 - p);
//   the tail:        [B_4, B_5), of length R p^16: then k = 4 + G, G the
//                    number of Bernoulli(p) successes before the first failure
//                    (Pr (1 - p) p^G), accepted if G (G + 7) more succeed;
//   rejected:        [B_5, 1),
//
// with B_0 = 0, B_k = c (p^0 + p^1 + p^4 + ... + p^((k-1)^2)), B_5 = B_4 + R p^16.
// Then Pr[k] = c p^(k^2) for k <= 3, and for k = 4 + G in the tail
// R p^16 (1 - p) p^G p^(G(G+7)) = c p^((4+G)^2): the same c for every k, so k
// is exactly the header's k (with the same cap kMaxK). R = 23/16 keeps
// B_5 = 0.99200... < 1 (checked where the table is built), so 0.8 % of the
// tries are rejected instead of 31 %, and Karney's loop runs about 1.41 times
// per sample instead of 2.03.
//
// Each B_b is a polynomial in p with rational coefficients, bounded in integer
// arithmetic from an interval of p (positive terms from its lower end,
// negative ones from its upper end); the table holds those bounds at 32 bits,
// widened by the margin, so the first 32 bits of U decide unless they fall
// next to a boundary; then the exact path compares U with each B_b.

constexpr int kTableK = 4;                  // k = 0..3 from the table, then the tail
constexpr int kBoundaries = kTableK + 1;    // B_1 .. B_5
constexpr int kTailRegion = kTableK;        // region index of the tail
constexpr int kRejectRegion = kTableK + 1;  // region index of the rejected part
constexpr uint64_t kRNum = 23, kRShift = 4;  // R = 23 / 2^4

// [lo, hi] with lo <= 2^P B_b <= hi for b = 1..kBoundaries.
void BoundaryInterval(int b, int P, Big* lo, Big* hi) {
  const int g = P + 48;  // guard bits for the 16 outward roundings
  Big p_lo, p_hi;
  ExpInterval(1, 2, g, &p_lo, &p_hi);
  Big one(g / 64 + 1, 0);
  one[g / 64] = 1ull << (g % 64);
  // Sums of the positive terms p^(i^2) (and p^16 for the tail) and of the negative terms p^(i^2 + 1).
  Big plus_lo, plus_hi, minus_lo, minus_hi, t_lo, t_hi;
  for (int i = 0; i < std::min(b, kTableK); ++i) {
    const uint64_t n = static_cast<uint64_t>(i) * i;
    if (n == 0) {
      plus_lo = Add(plus_lo, one), plus_hi = Add(plus_hi, one);
    } else {
      PowerInterval(p_lo, p_hi, n, g, &t_lo, &t_hi);
      plus_lo = Add(plus_lo, t_lo), plus_hi = Add(plus_hi, t_hi);
    }
    PowerInterval(p_lo, p_hi, n + 1, g, &t_lo, &t_hi);
    minus_lo = Add(minus_lo, t_lo), minus_hi = Add(minus_hi, t_hi);
  }
  if (b == kBoundaries) {
    PowerInterval(p_lo, p_hi, kTableK * kTableK, g, &t_lo, &t_hi);
    plus_lo = Add(plus_lo, t_lo), plus_hi = Add(plus_hi, t_hi);
  }
  const Big lower = Compare(plus_lo, minus_hi) > 0 ? Sub(plus_lo, minus_hi) : Big{};
  const Big upper = Sub(plus_hi, minus_lo);
  *lo = ShiftRight(Mul(lower, Big{kRNum}), g - P + kRShift, false);
  *hi = ShiftRight(Mul(upper, Big{kRNum}), g - P + kRShift, true);
}

class KTable {
 public:
  KTable(double margin, FastPathCheck* check) : check_(check) {
    const uint64_t widen = static_cast<uint64_t>(std::ceil(std::ldexp(margin, kFastBits)));
    for (int b = 0; b < kBoundaries; ++b) {
      Big lo, hi;
      BoundaryInterval(b + 1, kFastBits, &lo, &hi);
      const uint64_t l = lo.empty() ? 0 : lo[0], h = hi.empty() ? 0 : hi[0];  // below 2^33
      lo_[b] = l > widen ? l - widen : 0;
      hi_[b] = h + widen;
    }
    // B_5 < 1 (R is small enough): hi is a bound of 2^32 B_5 at margin 0.
    Big lo, hi;
    BoundaryInterval(kBoundaries, kFastBits, &lo, &hi);
    valid_ = hi.size() == 1 && hi[0] < (1ull << kFastBits);
  }

  bool valid() const { return valid_; }

  // The region of U: the number of boundaries B_1..B_5 at or below U.
  // U's first 32 bits are u (more are drawn from `rng` if needed).
  int Region(RandomBits& rng, uint64_t u) const {
    int c = 0;
    for (int b = 0; b < kBoundaries; ++b) c += u >= hi_[b];  // U >= B_b for these (hi_ increases)
    // U < B_c if u + 1 <= lo_[c] (then also below the later ones: lo_ increases).
    const bool decided = c == kBoundaries || u < lo_[c];
    if (__builtin_expect(decided && check_ == nullptr, 1)) return c;
    const int exact = ExactRegion(rng, u);
    if (decided && exact != c) check_->disagreed = true;
    return exact;
  }

 private:
  static int ExactRegion(RandomBits& rng, uint64_t u) {
    std::vector<uint64_t> digits = {(u << 32) | rng.Bits(32)};
    int c = 0;
    while (c < kBoundaries &&
           !LessExact(rng, &digits, [c](int p, Big* lo, Big* hi) { BoundaryInterval(c + 1, p, lo, hi); })) {
      ++c;
    }
    return c;
  }

  uint64_t lo_[kBoundaries], hi_[kBoundaries];
  bool valid_;
  FastPathCheck* check_;
};

// ------------------------------------------------------------- Karney D --

// k is capped here (see the header).
constexpr uint64_t kMaxK = 4096;
constexpr int kCeilTable = 64;

// floor(sqrt(x)) for x < 2^127.
uint64_t FloorSqrt(u128 x) {
  uint64_t r = static_cast<uint64_t>(std::sqrt(static_cast<long double>(x)));
  while (static_cast<u128>(r) * r > x) --r;
  while (static_cast<u128>(r + 1) * (r + 1) <= x) ++r;
  return r;
}

class KarneySampler {
 public:
  KarneySampler(u128 v, double margin, FastPathCheck* check = nullptr)
      : v_(v), inv_two_v_(1.0 / ToDouble(2 * v)), width_(CeilSigmaTimes(1)), k_table_(margin, check),
        exp_(2 * v, margin, check), half_(1, 2) {
    for (int k = 0; k < kCeilTable; ++k) {
      ceil_[k] = CeilSigmaTimes(k);
      two_ceil_[k] = TwoCeilDouble(ceil_[k]);
      rest_[k] = RestOver2v(k, ceil_[k]);
    }
  }

  bool valid() const { return k_table_.valid(); }

  // Fills y[0, n) with independent samples: tries of steps 1-3 one after the
  // other, each written at the next free place and kept only if accepted, so
  // no branch depends on whether a try is accepted (30 % are not, at random,
  // which a branch predictor cannot learn).
  void Fill(RandomBits& rng, int64_t* y, int64_t n) const {
    for (int64_t filled = 0; filled < n;) {
      bool accepted;
      y[filled] = Try(rng, &accepted);
      filled += accepted;
    }
  }

 private:
  // One try of steps 1-3: its value, and whether it is accepted.
  int64_t Try(RandomBits& rng, bool* accepted) const {
    // Two words: 32 bits for the k table and 32 for the acceptance (independent
    // bits of one word), then the sign and 63 bits for j.
    const uint64_t r = rng.Word();
    // k with Pr ~ exp(-k^2 / 2) (the k table's comment).
    const int region = k_table_.Region(rng, r >> 32);
    uint64_t k = region;
    bool ok = true;
    if (__builtin_expect(region >= kTailRegion, 0)) {
      k = region == kTailRegion ? TailK(rng) : 0;  // 0: rejected
      ok = k != 0;
    }
    const uint64_t s = rng.Word();
    const bool negative = s & 1;
    const uint64_t j = rng.Below63(width_, s >> 1);
    const u128 m = Ceil(k) + j;
    ok &= (m < Ceil(k + 1)) & !((m == 0) & negative);
    // Accept with exp(-(m^2 - k^2 v) / (2 v)). With c = ceil(k sigma), m = c + j and
    // m^2 - k^2 v = (c^2 - k^2 v) + j (2c + j), two non-negative terms, so in double
    // x = j (2c + j) / (2v) + (c^2 - k^2 v) / (2v) is within a relative 9 * 2^-53 of
    // the exact ratio: j < 2^51 converts exactly; 2c (1 rounding), the sum with j (1),
    // the product (1), 1/(2v) (2v to double: 3, the division: 1) and the product (1)
    // make 8, as does rest_ (c^2 - k^2 v to double: 3, 1/(2v): 4, the product: 1), and
    // the final sum 1. (A try already rejected is still drawn through, harmlessly.)
    const double jd = static_cast<double>(static_cast<int64_t>(j));
    const double x = jd * (TwoCeil(k) + jd) * inv_two_v_ + Rest(k);
    ok &= exp_(rng, r & 0xffffffffull, x, [&] { return m * m - KSquaredV(k); });
    *accepted = ok;
    const int64_t y = static_cast<int64_t>(m);
    return negative ? -y : y;
  }

  // k = kTableK + G in the tail region, or 0 when rejected (or above kMaxK).
  uint64_t TailK(RandomBits& rng) const {
    uint64_t g = 0;
    while (half_(rng)) ++g;
    const uint64_t k = kTableK + g;
    if (k > kMaxK) return 0;
    for (uint64_t i = 0, n = g * (g + 2 * kTableK - 1); i < n; ++i) {
      if (!half_(rng)) return 0;
    }
    return k;
  }

  // k^2 v < 2^124 (k <= kMaxK + 1, v <= 2^100): needs 128 bits. The one place it is computed.
  u128 KSquaredV(uint64_t k) const { return static_cast<u128>(k) * k * v_; }

  // ceil(k sqrt(v)) = the least m with m^2 >= k^2 v.
  uint64_t CeilSigmaTimes(uint64_t k) const {
    const u128 x = KSquaredV(k);
    return x == 0 ? 0 : FloorSqrt(x - 1) + 1;
  }

  uint64_t Ceil(uint64_t k) const { return k < kCeilTable ? ceil_[k] : CeilSigmaTimes(k); }

  // 2 ceil(k sigma) as a double (< 2^64: ceil(k sigma) < 2^63), one rounding.
  static double TwoCeilDouble(uint64_t c) { return ToDouble(static_cast<u128>(c) * 2); }
  double TwoCeil(uint64_t k) const { return k < kCeilTable ? two_ceil_[k] : TwoCeilDouble(Ceil(k)); }

  // (c^2 - k^2 v) / (2v) in double for c = ceil(k sigma) (8 roundings, see Sample).
  double RestOver2v(uint64_t k, uint64_t c) const {
    return ToDouble(static_cast<u128>(c) * c - KSquaredV(k)) * inv_two_v_;
  }
  double Rest(uint64_t k) const { return k < kCeilTable ? rest_[k] : RestOver2v(k, Ceil(k)); }

  u128 v_;
  double inv_two_v_;  // 1/(2v): 2v to double (3 roundings), the division (1)
  uint64_t width_;    // ceil(sigma): j is uniform on [0, width_)
  uint64_t ceil_[kCeilTable];
  double two_ceil_[kCeilTable], rest_[kCeilTable];
  KTable k_table_;
  ExpBernoulli exp_;
  ConstantExpBernoulli half_;
};

// ------------------------------------------------------------------- op --

REGISTER_OP("TfeDiscreteGaussian")
    .Input("shape: int64")
    .Input("variance: float64")
    .Output("noise: int64")
    .Attr("fast_path_margin_log2: int = 40")
    .Attr("check_fast_paths: bool = false")
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
integer in [1, 2**100]. `fast_path_margin_log2` (1..50): the margin 2^-m of the
double-precision bounds that decide most Bernoulli(exp) draws (added to a
rigorous bound on their rounding error) and of the k table's bounds; any value
gives the same distribution (the rest is decided exactly); small values only
make the exact path run more often (tests use that to exercise it).
`check_fast_paths` (tests only, slow): every decision of a fast path is taken
again by the exact path with the same uniform bits, and the op fails if they
ever disagree.
)doc");

class DiscreteGaussianOp : public OpKernel {
 public:
  explicit DiscreteGaussianOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    RequireSelfTest(ctx);
    int margin_log2 = 40;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fast_path_margin_log2", &margin_log2));
    OP_REQUIRES(ctx, margin_log2 >= 1 && margin_log2 <= 50,
                ::tensorflow::errors::InvalidArgument("TfeDiscreteGaussian: fast_path_margin_log2 must be in "
                                                      "[1, 50] (a margin on top of the bounds' rounding error), got ",
                                                      margin_log2));
    margin_ = std::ldexp(1.0, -margin_log2);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check_fast_paths", &check_fast_paths_));
  }

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

    FastPathCheck check;
    const KarneySampler sampler(static_cast<u128>(variance), margin_,  // exact: an integer below 2^101
                                check_fast_paths_ ? &check : nullptr);
    OP_REQUIRES(ctx, sampler.valid(), ::tensorflow::errors::Internal("TfeDiscreteGaussian: the k table's "
                                                                      "regions do not fit in [0, 1)"));
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
                            sampler.Fill(rng, y + c * kNoiseChunk, last - c * kNoiseChunk);
                            failed[c] = !rng.ok();
                          }
                        });
    std::memset(key, 0, sizeof(key));
    for (uint8_t f : failed) OP_REQUIRES(ctx, !f, ::tensorflow::errors::Internal("AES-128-CTR failed"));
    OP_REQUIRES(ctx, !check.disagreed, ::tensorflow::errors::Internal("TfeDiscreteGaussian: a fast path "
                                                                       "disagreed with the exact path"));
  }
 private:
  double margin_ = 0;
  bool check_fast_paths_ = false;
};
REGISTER_KERNEL_BUILDER(Name("TfeDiscreteGaussian").Device(DEVICE_CPU).HostMemory("shape"),
                        DiscreteGaussianOp);

}  // namespace
}  // namespace tfe_estimator
