"""tfe_backend's compatibility pieces: the TF 2.15 import shim and our generator inside tf-encrypted."""
import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator import InsecureRandomnessError
from tfe_estimator.secure import kernels, protocols


@pytest.fixture
def backend():
    return protocols.load_backend()


def test_dropped_while_v2_flag_is_defined_for_tf_encrypted(backend):
    from tensorflow.python.ops import while_v2  # pylint: disable=import-outside-toplevel

    del backend
    assert while_v2.glob_stateful_parallelism is False  # TF 2.9's default, defined on 2.15


def test_tf_encrypted_draws_every_random_value_from_our_aes_ops(backend):
    from tf_encrypted.operations import secure_random  # pylint: disable=import-outside-toplevel

    # Prepare: tf-encrypted's own API, as its protocols call it.
    graph = tf.Graph()
    with graph.as_default():
        seed = secure_random.secure_seed()
        seeded = [secure_random.seeded_random_uniform([64], minval=0, maxval=1000, dtype=tf.int64, seed=seed)
                  for _ in range(2)]
        fresh = secure_random.random_uniform([64], minval=0, maxval=1000, dtype=tf.int64)
    # Execute
    with tf.compat.v1.Session(graph=graph) as sess:
        first, second, other = sess.run(seeded + [fresh])
    # Assert: our ops only (tf-encrypted's are SecureSeed, SecureSeededRandomUniform, ...).
    types = {op.type for op in graph.get_operations()} - {"Const"}
    assert types == {"TfeAesSeed", "TfeAesSeededRandomUniform", "TfeAesRandomUniform"}
    assert secure_random.supports_seeded_randomness()
    np.testing.assert_array_equal(first, second)  # a function of the seed
    assert not np.array_equal(first, other) and first.min() >= 0 and first.max() < 1000
    assert backend._tfe_secure_random_impl.secure_random_module is backend._installed  # pylint: disable=protected-access


def test_without_the_kernel_library_nothing_falls_back(backend, monkeypatch):
    # Plant the fault: the kernel library cannot be built; tf-encrypted's module
    # is whatever it loaded itself (its ChaCha op on TF 2.9.1, None on 2.15).
    impl = backend._tfe_secure_random_impl  # pylint: disable=protected-access

    def broken(fallback=None):
        raise kernels.KernelBuildError("no compiler")

    monkeypatch.setattr(kernels, "tfe_random_module", broken)
    monkeypatch.setattr(impl, "secure_random_module", backend._installed._fallback)  # pylint: disable=protected-access
    monkeypatch.setattr(backend, "_installed", None)
    with pytest.raises(kernels.KernelBuildError, match="no compiler"):
        backend.require_secure_randomness()
    with pytest.raises(kernels.KernelBuildError, match="no compiler"):
        protocols.load_backend(require_secure_randomness=False)  # servers too


def test_tf_encrypted_without_secure_randomness_is_refused(backend, monkeypatch):
    from tf_encrypted.operations import secure_random  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(secure_random, "supports_secure_randomness", lambda: False)
    with pytest.raises(InsecureRandomnessError, match="AES-CTR generator .* refuses to run"):
        backend.require_secure_randomness()
