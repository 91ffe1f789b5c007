"""Installs tfe_estimator, model_fns and input_fns, and the `tfe-estimator` command.

The supported ranges are stated here (see README, "Versions"): Python 3.10 or
3.11; TensorFlow 2.9 to 2.15 with tensorflow-estimator (the `estimator` extra:
Estimator's last release is 2.15; TensorFlow 2.16 has none), or TensorFlow 2.21
with Keras 3 for Keras only (`TfeStrategy`). The exact sets CI tests are the
constraint files `requirements/tf215.txt` (default: Python 3.11, TensorFlow
2.15.1), `requirements/tf29.txt` (Python 3.10, TensorFlow 2.9.1) and
`requirements/tf221.txt` (Python 3.11, TensorFlow 2.21.0, Keras only), which
`scripts/venv.sh` installs with. `tfe_estimator.compat` refuses any other
TensorFlow at import.
"""
import pathlib
import re

from setuptools import find_packages
from setuptools import setup

HERE = pathlib.Path(__file__).parent
VERSION = re.search(
    r'__version__ = "([^"]+)"', (HERE / "tfe_estimator" / "_version.py").read_text()
).group(1)

INSTALL_REQUIRES = [
    # not tensorflow-cpu: tf-encrypted requires this name. 2.16-2.20 are not read (tfe_estimator.compat).
    "tensorflow>=2.9,!=2.16.*,!=2.17.*,!=2.18.*,!=2.19.*,!=2.20.*,<2.22",
    "tf-encrypted==0.9.1",
    # tf-encrypted's undeclared needs: `import tf_encrypted` imports onnx.mapping
    # (gone in onnx 1.16) and pkg_resources (gone from setuptools 70).
    "onnx>=1.12,<1.16",
    "tf2onnx>=1.13",
    "pyyaml>=6",
    "setuptools<70",
    "numpy>=1.22,<3",  # 1.x on the Estimator stacks, 2.x with TensorFlow 2.21
    "protobuf<8",  # 3.19 (TF 2.9), 4.25 (TF 2.15), 7.x (TF 2.21)
    "scikit-learn>=1.2,<1.6",  # the demo's real data sets ship with it
    "portpicker>=1.5,<2",  # free ports for loopback clusters
    "filelock>=3.12",  # one build of the kernel library at a time
    "cryptography>=41",  # certificates for mutual TLS between tasks (cluster.certs)
    # the aggregation servers' standard gRPC health service; each release needs its protobuf: 1.48.2 on the
    # TF 2.9 stack (3.19), 1.62.3 on TF 2.15 (4.25), 1.85.1 on TF 2.21 (7.x)
    "grpcio-health-checking>=1.48,<2",
    "prometheus_client>=0.17,<1",  # the aggregation servers' metrics (`tfe-estimator server --metrics-port`)
]

EXTRAS_REQUIRE = {
    # Estimator (TfeRunConfig, the demo, model_fns): TensorFlow 2.9 to 2.15, whose last release has it.
    # Without this extra the newest supported TensorFlow is installed: 2.21, Keras only (TfeStrategy).
    "estimator": ["tensorflow>=2.9,<2.16", "tensorflow-estimator>=2.9,<2.16"],
    "test": [
        "pytest>=7.4,<10",
        "pytest-timeout>=2.2,<3",
        "pytest-xdist>=3.5,<4",  # `make test` runs the in-process tests on two workers (scripts/test.sh)
        "hypothesis>=6.80,<7",
        "scipy>=1.10,<1.18",
        "matplotlib>=3.7,<3.12",  # the benchmark's smoke test draws its plot
        "kubernetes-validate>=1.28,<2",  # rendered manifests are checked against the schemas, offline
        "mkdocs>=1.5,<2",  # docs/ is built with `mkdocs build --strict` by tests/test_docs.py
        "ruff>=0.6",  # tests/test_lint.py lints the package (ruff.toml)
    ],
    "bench": ["matplotlib>=3.7,<3.12"],
    # Distributed DP; tensorflow-privacy 0.9.0 needs TensorFlow 2.14/2.15 and
    # Python < 3.12, so only the default stack (requirements/tf215.txt) has it.
    "dp": ["tensorflow-privacy==0.9.0", "dp-accounting>=0.4.3"],
}

setup(
    name="tfe-estimator",
    version=VERSION,
    description="Secure aggregation for TensorFlow Estimator with TF Encrypted.",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: Security :: Cryptography",
    ],
    python_requires=">=3.10,<3.12",
    packages=find_packages(include=["tfe_estimator", "tfe_estimator.*", "model_fns", "input_fns"]),
    package_data={"tfe_estimator.secure.kernels": ["src/*"],  # built by `tfe-estimator build-kernels`
                  "tfe_estimator.service": ["native/*.cc"]},  # the C data-plane link, built on first use
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["tfe-estimator=tfe_estimator.tools.cli:main"]},
)
