"""`AesRandomModule`: our AES-128-CTR generator in the shape tf-encrypted expects.

tf-encrypted draws every random share through
``tf_encrypted.operations.secure_random.secure_random_module``, an op module
with ``secure_seed``, ``secure_seeded_random_uniform`` and
``secure_random_uniform`` (and ``i128_*`` variants for its 128-bit ring).
Its own module is ChaCha, compiled for TensorFlow 2.9.1 only. An
`AesRandomModule` put in its place gives Pond and ABY3 AES-CTR randomness
on any TensorFlow; ``tfe_backend`` installs it. The ``i128_*`` functions are
delegated to `fallback` (tf-encrypted's module where it loads), else refused.

Example::

    module = AesRandomModule(kernels.load(), fallback=None)
    seed = module.secure_seed()
    x = module.secure_seeded_random_uniform([3], seed, tf.constant(0, tf.int64),
                                            tf.constant(10, tf.int64))
"""

__all__ = ["AesRandomModule"]


class AesRandomModule:
    """tf-encrypted's secure-random interface backed by `tfe_estimator.secure.kernels`.

    Args:
      library: the op module returned by `tfe_estimator.secure.kernels.load()`.
      fallback: a module providing tf-encrypted's ``i128_*`` ops, or None.
    """

    def __init__(self, library, fallback=None) -> None:
        self._lib = library
        self._fallback = fallback

    def secure_seed(self, name=None):
        """A fresh 128-bit key (4 int32) from RAND_bytes."""
        return self._lib.tfe_aes_seed(name=name)

    def secure_seeded_random_uniform(self, shape, seed, minval, maxval, name=None):
        """Uniform integers in [minval, maxval), a deterministic function of `seed`."""
        return self._lib.tfe_aes_seeded_random_uniform(shape, seed, minval, maxval, name=name)

    def secure_random_uniform(self, shape, minval, maxval, name=None):
        """Uniform integers in [minval, maxval) under a fresh key."""
        return self._lib.tfe_aes_random_uniform(shape, minval, maxval, name=name)

    def i128_secure_seeded_random_uniform(self, shape, seed, minval, maxval, name=None):
        """tf-encrypted's 128-bit ring op, keyed from our 128-bit seed.

        Its op takes a 256-bit ChaCha key (8 int32); ours are 128-bit AES keys,
        so the key is derived deterministically as the first 8 words of the
        seed's AES-CTR keystream (AES as a PRF), and every party holding the
        seed derives the same key, as replicated sharing requires.
        """
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        fallback = self._require_fallback("i128_secure_seeded_random_uniform")
        key = self.secure_seeded_random_uniform(
            [8], seed, tf.constant(-2**31, tf.int32), tf.constant(2**31 - 1, tf.int32))
        return fallback.i128_secure_seeded_random_uniform(shape, key, minval, maxval, name=name)

    def _require_fallback(self, name):
        if self._fallback is None:
            raise NotImplementedError(
                f"tf-encrypted's 128-bit ring op {name!r} is not available with this TensorFlow "
                "(tf-encrypted 0.9.1 ships it for TensorFlow 2.9.1 only). Use precision='low', or "
                "protocol='pond', whose 128-bit sum runs on tfe_estimator's own kernels."
            )
        return self._fallback

    def __getattr__(self, name):
        if name.startswith("i128_"):
            return getattr(self._require_fallback(name), name)
        raise AttributeError(name)
