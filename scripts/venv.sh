#!/usr/bin/env bash
# Creates or reuses the virtualenv of one supported stack and installs the
# project into it with the given extras:
#
#   scripts/venv.sh [extras]              # STACK=tf215 (default): .venv, Python 3.11, TF 2.15.1
#   STACK=tf29 scripts/venv.sh [extras]   # .venv-tf29, Python 3.10, TF 2.9.1
#   STACK=tf221 scripts/venv.sh [extras]  # .venv-tf221, Python 3.11, TF 2.21.0, Keras 3 (Keras only)
#
# The exact package versions come from requirements/<stack>.txt, used as pip
# constraints (the one place they are pinned; setup.py states the ranges).
# A venv is reused as it is when setup.py, the constraints file, the extras,
# the Python version and this script have not changed since it was last
# installed (a hash in <venv>/.installed). Afterwards the kernel library is
# built (or found up to date) for that venv's TensorFlow.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
stack="${STACK:-tf215}"

case "$stack" in
  tf215) venv=.venv;      pyver=3.11 ;;
  tf29)  venv=.venv-tf29; pyver=3.10 ;;
  tf221) venv=.venv-tf221; pyver=3.11 ;;
  *) echo "error: unknown STACK=$stack; use tf215 (Python 3.11, TensorFlow 2.15.1, the default)," \
          "tf29 (Python 3.10, TensorFlow 2.9.1) or tf221 (Python 3.11, TensorFlow 2.21.0, Keras only)." >&2; exit 2 ;;
esac
constraints="requirements/$stack.txt"

is_pyver() {  # is_pyver <python> : does it run Python $pyver?
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$pyver'.split('.'))))" 2>/dev/null
}

find_python() {
  local cand
  for cand in "${PYTHON:-}" "python$pyver" python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if is_pyver "$cand"; then echo "$cand"; return 0; fi
  done
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$pyver".*/bin/python"$pyver"; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  return 1
}

want="$(cat setup.py "$constraints" "$0"; echo "stack=$stack extras=$extras python=$pyver")"
want_hash="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.installed" ] \
   && [ "$(cat "$venv/.installed")" = "$want_hash" ]; then
  echo "reusing $venv ($stack, requirements unchanged)"
else
  if [ ! -x "$venv/bin/python" ] || ! is_pyver "$venv/bin/python"; then
    py="$(find_python)" || {
      echo "error: STACK=$stack needs Python $pyver (TensorFlow and tf-encrypted wheels of" >&2
      echo "that stack exist for it). Install it, e.g. 'pyenv install $pyver', or set" >&2
      echo "PYTHON=/path/to/python$pyver." >&2
      exit 1
    }
    echo "creating $venv with $("$py" --version) for STACK=$stack"
    rm -rf "$venv"
    "$py" -m venv "$venv"
  fi
  rm -f "$venv/.installed"
  # pip 25 drops the legacy editable install that setup.py (no pyproject.toml) uses.
  "$venv/bin/python" -m pip install --quiet -c "$constraints" --upgrade "pip<25"
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  echo "installing $spec into $venv with $constraints (TensorFlow takes a few minutes the first time)"
  "$venv/bin/python" -m pip install --quiet -c "$constraints" -e "$spec"
  "$venv/bin/python" -m pip check
  echo "$want_hash" > "$venv/.installed"
fi

# The kernel library (AES-CTR masks, the fused Pond sum) is compiled against
# this venv's TensorFlow, into a per-user cache keyed by TensorFlow, Python and
# the sources: a no-op when it is up to date.
"$venv/bin/tfe-estimator" build-kernels
