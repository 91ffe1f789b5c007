"""The wheel holds the library only: no benchmark or attack tools (they live in the checkout's tools/)."""
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_has_no_developer_tools(tmp_path):
    # Prepare: a copy of the checkout's sources (the build writes build/ and *.egg-info next to setup.py).
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in ("tfe_estimator", "model_fns", "input_fns", "tools"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    # Execute: build the wheel as pip would, offline.
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tfe_estimator-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # Assert
    assert "tfe_estimator/tools/cli.py" in names and "tfe_estimator/secure/kernels/src/aes_ctr.h" in names
    assert "tfe_estimator/service/native/tls_link.cc" in names  # the C data-plane link, built on first use
    tools = [n for n in names if "bench" in n or "attack" in n or n.startswith("tools/")]
    assert tools == [], tools


def test_the_image_installs_dp_keeps_virtualenvs_out_and_has_one_name_across_the_docs():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "'.[estimator,dp]'" in dockerfile  # Estimator and distributed DP work in the image
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".venv-*", "build", "dist", "bench-results", "*.egg-info"} <= ignored, ignored
    for copied in ("setup.py", "requirements", "tfe_estimator", "model_fns", "input_fns"):  # what it COPYs
        assert copied not in ignored
    images = set()
    for path in [ROOT / "deploy" / "Dockerfile", ROOT / "deploy" / "kubernetes" / "README.md",
                 *sorted((ROOT / "docs").glob("*.md"))]:
        images |= {word.strip("`'\",()") for word in path.read_text().split()
                   if word.startswith("registry.example.com/") and "sidecar" not in word}
    assert images == {"registry.example.com/tfe-train:1.0"}, images
