"""tfe_estimator's own TensorFlow kernels: AES-128-CTR masks and the fused Pond sum.

The hot path of a secure sum is drawing masks. tf-encrypted 0.9.1's ChaCha
op costs ~5.5 ns per 64-bit word and exists for TensorFlow 2.9.1 only; these
kernels draw AES-128-CTR keystream from the BoringSSL inside TensorFlow's own
wheel (~1 ns per word with AES-NI), are compiled against whatever TensorFlow
is installed, and fuse each party's work into one pass (see
``src/secure_sum_ops.cc``).

`load()` compiles the library on first use (into a per-user cache, under a
file lock; ``tfe-estimator build-kernels`` does it ahead of time), loads it,
and runs the NIST SP 800-38A F.5.1 known-answer test: if that fails the
library refuses to run. Every process that runs these ops must call `load()`
before its TensorFlow server starts; `tfe_estimator.secure.protocols.load_backend`
does.

Example::

    from tfe_estimator.secure import kernels
    lib = kernels.load()            # builds once, self-tests, returns the op module
    seed = lib.tfe_aes_seed()
"""
import threading

from tfe_estimator.secure.kernels._build import KernelBuildError, build, library_path

__all__ = ["load", "build", "library_path", "KernelBuildError", "KernelSelfTestError", "tfe_random_module"]

_LOCK = threading.Lock()
_LIBRARY = None


class KernelSelfTestError(RuntimeError):
    """The AES-128-CTR known-answer test failed: the cipher library is unusable."""


def load():
    """Builds (if needed), loads and self-tests the kernel library; returns its op module.

    Raises:
      KernelBuildError: the library could not be compiled.
      KernelSelfTestError: the NIST known-answer test failed.
    """
    global _LIBRARY  # pylint: disable=global-statement
    with _LOCK:
        if _LIBRARY is None:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel

            library = tf.load_op_library(str(build()))
            _self_test(tf, library)
            _LIBRARY = library
    return _LIBRARY


def _self_test(tf, library) -> None:
    # In a graph session of its own: it neither starts the eager runtime nor
    # touches the caller's graph.
    with tf.Graph().as_default():
        report = library.tfe_aes_self_test()
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 1}, inter_op_parallelism_threads=1)
        try:
            with tf.compat.v1.Session(config=config) as session:
                session.run(report)
        except tf.errors.OpError as e:
            raise KernelSelfTestError(
                f"{e.message} Reinstall TensorFlow (its BoringSSL provides the cipher) and "
                "rebuild with `tfe-estimator build-kernels --force`."
            ) from None


def tfe_random_module(fallback=None):
    """An object tf-encrypted can use as its ``secure_random_module`` (see `random_module`)."""
    from tfe_estimator.secure.kernels.random_module import AesRandomModule  # pylint: disable=import-outside-toplevel

    return AesRandomModule(load(), fallback)
