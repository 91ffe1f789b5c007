"""Installs tfe_estimator, model_fns and input_fns, and the `tfe-estimator` command.

This file is the one place where dependency versions are pinned. The set is
the only one known to work together (see README, "Versions"): tf-encrypted
0.9.1 ships its custom secure-randomness ops compiled for TensorFlow 2.9.1
only, and TensorFlow 2.9 wheels exist for Python 3.7 to 3.10.
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
    "tensorflow==2.9.1",  # not tensorflow-cpu: tf-encrypted requires this name
    "tensorflow-estimator==2.9.0",
    "tf-encrypted==0.9.1",
    "numpy<1.24",
    "protobuf<3.20",
    "onnx==1.12.0",
    "tf2onnx==1.13.0",
    "setuptools<70",  # tf-encrypted imports pkg_resources
    "scikit-learn>=1.2,<1.4",  # the demo's real data sets ship with it
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=7.4,<10",
        "pytest-timeout>=2.2,<3",
        "hypothesis>=6.80,<7",
        "scipy>=1.10,<1.16",
        "matplotlib>=3.7,<3.10",  # the benchmark's smoke test draws its plot
    ],
    "bench": ["matplotlib>=3.7,<3.10"],
}

setup(
    name="tfe-estimator",
    version=VERSION,
    description="Secure aggregation for TensorFlow Estimator with TF Encrypted.",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.11",
    packages=find_packages(include=["tfe_estimator", "tfe_estimator.*", "model_fns", "input_fns"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["tfe-estimator=tfe_estimator.cli:main"]},
)
