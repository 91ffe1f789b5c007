"""The package and the developer tools pass the linter (ruff, configured in ruff.toml), so CI's test command lints them."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_package_passes_ruff():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "tfe_estimator", "model_fns", "input_fns", "tools"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    # ruff missing ("No module named ruff"): it is in the test extra, pip install -e '.[test]'.
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
