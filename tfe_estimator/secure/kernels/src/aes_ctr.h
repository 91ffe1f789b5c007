// AES-128 in counter mode from the BoringSSL that TensorFlow's own wheel ships
// (headers under include/external/boringssl/src/include, symbols exported by
// libtensorflow_framework.so.2). Nothing here implements a cipher: every
// block is encrypted by EVP_aes_128_ctr, which uses AES-NI where the CPU has it.
//
// Keystream convention shared by every op of this library: the 16-byte
// counter block is the big-endian 128-bit integer `first_block + k` for the
// k-th block, so the keystream of one key is seekable: block b can be produced
// without the blocks before it. That makes multi-threaded output identical to
// single-threaded output.
#ifndef TFE_ESTIMATOR_KERNELS_AES_CTR_H_
#define TFE_ESTIMATOR_KERNELS_AES_CTR_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "openssl/evp.h"
#include "openssl/rand.h"

namespace tfe_estimator {

// Every cipher call reports failure through its return value; the kernel
// build turns an unchecked one into an error (-Werror=unused-result).
#define TFE_MUST_CHECK __attribute__((warn_unused_result))

constexpr int kKeyBytes = 16;
constexpr int kBlockBytes = 16;

// Encrypts (XORs with the keystream) `n` bytes of `in` into `out` (which may
// equal `in`) under `key`, starting at the 16-byte counter block `iv`.
// Returns false if the library reports an error.
TFE_MUST_CHECK inline bool AesCtrXor(const uint8_t key[kKeyBytes], const uint8_t iv[kBlockBytes],
                      const uint8_t* in, uint8_t* out, size_t n) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (ctx == nullptr) return false;
  bool ok = EVP_EncryptInit_ex(ctx, EVP_aes_128_ctr(), nullptr, key, iv) == 1;
  size_t done = 0;
  while (ok && done < n) {
    // EVP_EncryptUpdate takes an int length.
    const int step = static_cast<int>(n - done > (1u << 30) ? (1u << 30) : n - done);
    int written = 0;
    ok = EVP_EncryptUpdate(ctx, out + done, &written, in + done, step) == 1 && written == step;
    done += step;
  }
  EVP_CIPHER_CTX_free(ctx);
  return ok;
}

// The counter block whose big-endian value is `high * 2**64 + low`.
inline void CounterBlock(uint64_t high, uint64_t low, uint8_t iv[kBlockBytes]) {
  for (int i = 0; i < 8; ++i) {
    iv[7 - i] = static_cast<uint8_t>(high >> (8 * i));
    iv[15 - i] = static_cast<uint8_t>(low >> (8 * i));
  }
}

// Writes `n` keystream bytes of `key` starting at block `first_block` (of the
// counter space whose high 64 bits are `stream`) into `out`: the encryption of
// zeros, read from a constant zero page instead of clearing `out` first.
TFE_MUST_CHECK inline bool AesCtrKeystream(const uint8_t key[kKeyBytes], uint64_t stream, uint64_t first_block,
                            uint8_t* out, size_t n) {
  static const uint8_t kZeros[1 << 15] = {};
  uint8_t iv[kBlockBytes];
  CounterBlock(stream, first_block, iv);
  if (n <= sizeof(kZeros)) return AesCtrXor(key, iv, kZeros, out, n);
  std::memset(out, 0, n);
  return AesCtrXor(key, iv, out, out, n);
}

// A fresh key from the library's CSPRNG.
TFE_MUST_CHECK inline bool FreshKey(uint8_t key[kKeyBytes]) { return RAND_bytes(key, kKeyBytes) == 1; }

// Known-answer test: NIST SP 800-38A, appendix F.5.1 (CTR-AES128.Encrypt).
// Returns an empty string on success, else what went wrong.
std::string AesCtrSelfTest();

// The self-test's result, computed once per process. Every kernel checks it
// in its constructor, so a process where the cipher is wrong runs no op.
bool AesCtrSelfTestPassed();

}  // namespace tfe_estimator

#endif  // TFE_ESTIMATOR_KERNELS_AES_CTR_H_
