// Cryptographically secure randomness from AES-128-CTR (BoringSSL's EVP):
//   TfeAesSelfTest             -> the NIST known-answer test, as an op
//   TfeAesCtrKeystream         -> raw keystream bytes (tests compare it with
//                                 the `cryptography` package)
//   TfeAesSeed                 -> a fresh 128-bit key from RAND_bytes
//   TfeAesSeededRandomUniform  -> uniform integers in [minval, maxval) from a key
//   TfeAesRandomUniform        -> the same from a fresh key
// The last three give tf-encrypted's protocols (Pond, ABY3) their randomness;
// see tfe_estimator/tfe_backend.py.
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "aes_ctr.h"
#include "common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/tensor_util.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfe_estimator {

std::string AesCtrSelfTest() {
  // NIST SP 800-38A, F.5.1 CTR-AES128.Encrypt.
  static const char* kKey = "2b7e151628aed2a6abf7158809cf4f3c";
  static const char* kCounter = "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";
  static const char* kPlain =
      "6bc1bee22e409f96e93d7e117393172a" "ae2d8a571e03ac9c9eb76fac45af8e51"
      "30c81c46a35ce411e5fbc1191a0a52ef" "f69f2445df4f9b17ad2b417be66c3710";
  static const char* kCipher =
      "874d6191b620e3261bef6864990db6ce" "9806f66b7970fdff8617187bb9fffdff"
      "5ae4df3edbd5d35e5b4f09020db03eab" "1e031dda2fbe03d1792170a0f3009cee";
  auto unhex = [](const char* hex) {
    std::vector<uint8_t> out(std::strlen(hex) / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
      out[i] = static_cast<uint8_t>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
    }
    return out;
  };
  const auto key = unhex(kKey), iv = unhex(kCounter), plain = unhex(kPlain), cipher = unhex(kCipher);
  std::vector<uint8_t> out(plain.size());
  if (!AesCtrXor(key.data(), iv.data(), plain.data(), out.data(), out.size())) {
    return "the EVP AES-128-CTR call failed";
  }
  if (out != cipher) return "the ciphertext differs from NIST SP 800-38A F.5.1";
  // Seeking: the keystream from block 2 must equal the tail of the stream.
  std::vector<uint8_t> tail(32), iv2 = iv;
  iv2[15] = static_cast<uint8_t>(iv2[15] + 2);  // 0xff + 2 carries into byte 14
  if (iv[15] + 2 > 0xff) iv2[14] = static_cast<uint8_t>(iv2[14] + 1);
  if (!AesCtrXor(key.data(), iv2.data(), plain.data() + 32, tail.data(), 32) ||
      std::memcmp(tail.data(), cipher.data() + 32, 32) != 0) {
    return "seeking into the keystream gave a different result";
  }
  return "";
}

bool AesCtrSelfTestPassed() {
  static std::once_flag once;
  static bool passed = false;
  std::call_once(once, [] { passed = AesCtrSelfTest().empty(); });
  return passed;
}

namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfeAesSelfTest")
    .Output("report: string")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc("Runs the NIST SP 800-38A F.5.1 AES-128-CTR known-answer test; fails if it does not pass.");

class AesSelfTestOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const std::string problem = AesCtrSelfTest();
    OP_REQUIRES(ctx, problem.empty(),
                ::tensorflow::errors::Internal("AES-128-CTR known-answer test failed: ", problem,
                                               ". The cipher library is broken; refusing to run."));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<::tensorflow::tstring>()() = "NIST SP 800-38A F.5.1 AES-128-CTR: passed";
  }
};
REGISTER_KERNEL_BUILDER(Name("TfeAesSelfTest").Device(DEVICE_CPU), AesSelfTestOp);

REGISTER_OP("TfeAesCtrKeystream")
    .Input("key: uint8")
    .Input("counter: uint8")
    .Input("num_bytes: int64")
    .Output("keystream: uint8")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return OkStatus();
    })
    .Doc("AES-128-CTR keystream of `key` (16 bytes) from counter block `counter` (16 bytes).");

class AesCtrKeystreamOp : public OpKernel {
 public:
  explicit AesCtrKeystreamOp(OpKernelConstruction* ctx) : OpKernel(ctx) { RequireSelfTest(ctx); }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& key = ctx->input(0);
    const Tensor& counter = ctx->input(1);
    const int64_t n = ctx->input(2).scalar<int64_t>()();
    OP_REQUIRES(ctx, key.NumElements() == kKeyBytes && counter.NumElements() == kBlockBytes,
                ::tensorflow::errors::InvalidArgument("key and counter must have 16 bytes each"));
    OP_REQUIRES(ctx, n >= 0, ::tensorflow::errors::InvalidArgument("num_bytes must be >= 0, got ", n));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    uint8_t* data = out->flat<uint8_t>().data();
    std::memset(data, 0, n);
    OP_REQUIRES(ctx, AesCtrXor(key.flat<uint8_t>().data(), counter.flat<uint8_t>().data(), data, data, n),
                ::tensorflow::errors::Internal("AES-128-CTR failed"));
  }
};
REGISTER_KERNEL_BUILDER(Name("TfeAesCtrKeystream").Device(DEVICE_CPU), AesCtrKeystreamOp);

REGISTER_OP("TfeAesSeed")
    .Output("seed: int32")
    .SetIsStateful()  // never constant-folded: a fresh key on every run
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(kSeedWords));
      return OkStatus();
    })
    .Doc("A fresh 128-bit AES key from the cipher library's CSPRNG (RAND_bytes), as 4 int32.");

class AesSeedOp : public OpKernel {
 public:
  explicit AesSeedOp(OpKernelConstruction* ctx) : OpKernel(ctx) { RequireSelfTest(ctx); }
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({kSeedWords}), &out));
    OP_REQUIRES(ctx, FreshKey(reinterpret_cast<uint8_t*>(out->flat<int32_t>().data())),
                ::tensorflow::errors::Internal("RAND_bytes failed: no secure seed"));
  }
};
REGISTER_KERNEL_BUILDER(Name("TfeAesSeed").Device(DEVICE_CPU), AesSeedOp);

// Uniform integers in [minval, maxval) without modulo bias: element i takes
// the 64-bit keystream word i and keeps it if it falls below the largest
// multiple of the range; a rejected element (probability < range / 2**64)
// redraws from its own counter space (stream = attempt, block = i), so every
// element is computed independently and the output does not depend on how
// the work is split between threads.
template <typename T>
void UniformFromKey(OpKernelContext* ctx, const uint8_t key[kKeyBytes], T minval, T maxval) {
  const Tensor& shape_t = ctx->input(0);
  TensorShape shape;
  OP_REQUIRES_OK(ctx, ::tensorflow::tensor::MakeShape(shape_t, &shape));
  OP_REQUIRES(ctx, minval < maxval,
              ::tensorflow::errors::InvalidArgument("minval must be below maxval, got [", minval, ", ",
                                                    maxval, ")"));
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
  T* data = out->flat<T>().data();
  const int64_t n = out->NumElements();
  // In uint64 arithmetic: the difference of two int64 can overflow int64.
  const uint64_t range = static_cast<uint64_t>(static_cast<int64_t>(maxval)) -
                         static_cast<uint64_t>(static_cast<int64_t>(minval));
  // Accept w < limit, where limit = 2**64 - (2**64 mod range); 0 means all.
  const uint64_t limit = -((-range) % range);
  std::vector<uint8_t> failed(NumChunks(n, 1), 0);
  ForEachChunk(ctx, n, 1, [&](int64_t c, int64_t first, int64_t count) {
    std::vector<uint64_t> words(count);
    if (!AesCtrKeystream(key, 0, first / kWordsPerBlock, reinterpret_cast<uint8_t*>(words.data()), count * 8)) {
      failed[c] = 1;
      return;
    }
    for (int64_t j = 0; j < count; ++j) {
      uint64_t w = words[j];
      for (uint64_t attempt = 1; limit != 0 && w >= limit; ++attempt) {
        uint8_t block[kBlockBytes];
        if (!AesCtrKeystream(key, attempt, static_cast<uint64_t>(first + j), block, kBlockBytes)) {
          failed[c] = 1;
          return;
        }
        std::memcpy(&w, block, 8);
      }
      data[first + j] = static_cast<T>(static_cast<uint64_t>(static_cast<int64_t>(minval)) + w % range);
    }
  });
  for (uint8_t f : failed) OP_REQUIRES(ctx, !f, ::tensorflow::errors::Internal("AES-128-CTR failed"));
}

::tensorflow::Status UniformShape(InferenceContext* c) {
  ::tensorflow::shape_inference::ShapeHandle out;
  TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(0, &out));
  c->set_output(0, out);
  return OkStatus();
}

REGISTER_OP("TfeAesSeededRandomUniform")
    .Input("shape: Tshape")
    .Input("seed: int32")
    .Input("minval: dtype")
    .Input("maxval: dtype")
    .Output("output: dtype")
    .Attr("dtype: {int32, int64}")
    .Attr("Tshape: {int32, int64} = DT_INT32")
    .SetShapeFn(UniformShape)
    .Doc("Uniform integers in [minval, maxval) from the AES-128-CTR keystream of `seed` (4 int32).");

template <typename T>
class AesSeededRandomUniformOp : public OpKernel {
 public:
  explicit AesSeededRandomUniformOp(OpKernelConstruction* ctx) : OpKernel(ctx) { RequireSelfTest(ctx); }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& seed = ctx->input(1);
    OP_REQUIRES(ctx, seed.NumElements() == kSeedWords,
                ::tensorflow::errors::InvalidArgument("seed must have 4 int32 (128 bits), got shape ",
                                                      seed.shape().DebugString()));
    UniformFromKey<T>(ctx, reinterpret_cast<const uint8_t*>(seed.flat<int32_t>().data()),
                      ctx->input(2).scalar<T>()(), ctx->input(3).scalar<T>()());
  }
};

REGISTER_OP("TfeAesRandomUniform")
    .Input("shape: Tshape")
    .Input("minval: dtype")
    .Input("maxval: dtype")
    .Output("output: dtype")
    .Attr("dtype: {int32, int64}")
    .Attr("Tshape: {int32, int64} = DT_INT32")
    .SetIsStateful()
    .SetShapeFn(UniformShape)
    .Doc("Uniform integers in [minval, maxval) from AES-128-CTR under a fresh key.");

template <typename T>
class AesRandomUniformOp : public OpKernel {
 public:
  explicit AesRandomUniformOp(OpKernelConstruction* ctx) : OpKernel(ctx) { RequireSelfTest(ctx); }
  void Compute(OpKernelContext* ctx) override {
    uint8_t key[kKeyBytes];
    OP_REQUIRES(ctx, FreshKey(key), ::tensorflow::errors::Internal("RAND_bytes failed"));
    UniformFromKey<T>(ctx, key, ctx->input(1).scalar<T>()(), ctx->input(2).scalar<T>()());
  }
};

#define REGISTER_UNIFORM(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                    \
      Name("TfeAesSeededRandomUniform").Device(DEVICE_CPU).TypeConstraint<T>("dtype").HostMemory("shape"), \
      AesSeededRandomUniformOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                                    \
      Name("TfeAesRandomUniform").Device(DEVICE_CPU).TypeConstraint<T>("dtype").HostMemory("shape"), \
      AesRandomUniformOp<T>);
REGISTER_UNIFORM(int32_t)
REGISTER_UNIFORM(int64_t)
#undef REGISTER_UNIFORM

}  // namespace
}  // namespace tfe_estimator
