"""Installs tfe_estimator, model_fns and input_fns, and the `tfe-estimator` command.

The supported ranges are stated here (see README, "Versions"): Python 3.10 or
3.11, TensorFlow and tensorflow-estimator 2.9 to 2.15 (Estimator's last
release; TensorFlow 2.16 has no Estimator). The exact sets CI tests are the
constraint files `requirements/tf215.txt` (default: Python 3.11, TensorFlow
2.15.1) and `requirements/tf29.txt` (Python 3.10, TensorFlow 2.9.1), which
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
    "tensorflow>=2.9,<2.16",  # not tensorflow-cpu: tf-encrypted requires this name
    "tensorflow-estimator>=2.9,<2.16",
    "tf-encrypted==0.9.1",
    # tf-encrypted's undeclared needs: `import tf_encrypted` imports onnx.mapping
    # (gone in onnx 1.16) and pkg_resources (gone from setuptools 70).
    "onnx>=1.12,<1.16",
    "tf2onnx>=1.13",
    "pyyaml>=6",
    "setuptools<70",
    "numpy>=1.22,<2",
    "protobuf<5",
    "scikit-learn>=1.2,<1.6",  # the demo's real data sets ship with it
    "portpicker>=1.5,<2",  # free ports for loopback clusters
    "filelock>=3.12",  # one build of the kernel library at a time
    "cryptography>=41",  # certificates for mutual TLS between tasks (cluster.certs)
    # the aggregation servers' standard gRPC health service; 1.63+ needs protobuf 5 (1.48.2 on the TF 2.9 stack's 3.19)
    "grpcio-health-checking>=1.48,<1.63",
    "prometheus_client>=0.17,<1",  # the aggregation servers' metrics (`tfe-estimator server --metrics-port`)
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=7.4,<10",
        "pytest-timeout>=2.2,<3",
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
    package_data={"tfe_estimator.secure.kernels": ["src/*"]},  # built by `tfe-estimator build-kernels`
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["tfe-estimator=tfe_estimator.tools.cli:main"]},
)
