"""Supported versions: the TensorFlow check at import and the protocol/precision table."""
import subprocess
import sys

import pytest
import tensorflow as tf

import tfe_estimator
from tfe_estimator import compat
from tfe_estimator.secure import protocols

ON_TF29 = tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 10)
RANGE = r">=2\.9,<2\.16 \(Estimator and Keras\) or 2\.21 \(Keras only\)"


@pytest.mark.parametrize("version", ["2.9.1", "2.9.0", "2.12.0", "2.15.1", "2.15.0rc1", "2.21.0"])
def test_supported_tensorflow_versions_pass(version):
    compat.check_tensorflow_version(version)


@pytest.mark.parametrize("version", ["2.8.4", "2.16.1", "2.20.0", "2.22.0", "3.0.0", "1.15.5"])
def test_unsupported_tensorflow_is_refused_naming_version_and_range(version):
    with pytest.raises(ImportError, match=rf"supports TensorFlow {RANGE}; TensorFlow {version} is installed"):
        compat.check_tensorflow_version(version)


def test_estimator_parts_are_refused_by_name_where_tensorflow_has_no_estimator():
    # Prepare: a process without tf.estimator (TensorFlow 2.21; elsewhere its version reads 2.21.0).
    code = ("import tensorflow as tf\ntf.__version__ = '2.21.0'\nimport tfe_estimator\n"
            "s = tfe_estimator.TfeStrategy\n"
            "try:\n    tfe_estimator.TfeRunConfig\nexcept ImportError as e:\n    print(e)\n")
    # Execute
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # Assert: the strategy imports, the RunConfig is refused naming itself and both fixes.
    assert "tfe_estimator.TfeRunConfig needs TensorFlow Estimator, which TensorFlow 2.21.0 does not have" \
        in out.stdout, out.stderr[-2000:]
    assert "tfe_estimator.TfeStrategy()" in out.stdout and "tensorflow==2.15.1" in out.stdout


def test_installed_tensorflow_is_supported():
    compat.check_tensorflow_version()


def test_import_refuses_an_unsupported_tensorflow():
    # Prepare: a process whose TensorFlow reports 2.16.1.
    code = ("import tensorflow as tf\ntf.__version__ = '2.16.1'\n"
            "try:\n    import tfe_estimator\nexcept ImportError as e:\n    print(e)\n")
    # Execute
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # Assert
    assert "TensorFlow 2.16.1 is installed" in out.stdout and ">=2.9,<2.16" in out.stdout, out.stderr[-2000:]
    assert "or 2.21 (Keras only)" in out.stdout


def test_aby3_high_is_refused_where_tf_encrypted_has_no_int128_ops():
    with pytest.raises(NotImplementedError) as info:
        protocols.check_supported("aby3", "high", tf_version="2.15.1")
    text = str(info.value)
    assert "protocol='aby3' with precision='high' is not available on TensorFlow 2.15.1" in text
    assert "protocol='aby3' with precision='low'" in text and "protocol='pond' with precision='high'" in text
    assert "STACK=tf29" in text


@pytest.mark.parametrize("protocol, precision", [("pond", "low"), ("aby3", "low"), ("pond", "high")])
def test_other_combinations_run_on_every_supported_tensorflow(protocol, precision):
    protocols.check_supported(protocol, precision, tf_version="2.15.1")
    protocols.check_supported(protocol, precision)


def test_supported_combinations_follow_the_installed_tensorflow():
    expected = {("pond", "low"), ("aby3", "low"), ("pond", "high")} | ({("aby3", "high")} if ON_TF29 else set())
    assert set(protocols.supported_combinations()) == expected


@pytest.mark.skipif(ON_TF29, reason="tf-encrypted's int128 ops exist on TF 2.9.1")
@pytest.mark.parametrize("build", [
    lambda: tfe_estimator.TfeStrategy(protocol="aby3", precision="high"),
    pytest.param(lambda: tfe_estimator.TfeRunConfig(protocol="aby3", precision="high"),
                 marks=pytest.mark.skipif(not compat.has_estimator(), reason="no Estimator on this TensorFlow")),
], ids=["TfeStrategy", "TfeRunConfig"])
def test_unsupported_combination_is_refused_at_construction(build):
    with pytest.raises(NotImplementedError, match="protocol='aby3' with precision='high' is not available"):
        build()
