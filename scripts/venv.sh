#!/usr/bin/env bash
# Creates .venv with Python 3.10 and installs the project with the given
# extras ("test", "bench", ...). Reuses an existing .venv when setup.py and
# the extras asked for have not changed since it was last installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv=.venv

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.10 python python3; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  return 1
}

want="$(cat setup.py; echo "extras=$extras")"
want_hash="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.installed" ] \
   && [ "$(cat "$venv/.installed")" = "$want_hash" ]; then
  exit 0
fi

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))'; then
  py="$(find_python)" || {
    echo "error: Python 3.10 is required (TensorFlow 2.9.1, which tf-encrypted 0.9.1" >&2
    echo "needs, has wheels for Python 3.7-3.10 only). Install it, e.g." >&2
    echo "'pyenv install 3.10', or set PYTHON=/path/to/python3.10." >&2
    exit 1
  }
  echo "creating $venv with $("$py" --version)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade "pip<25" wheel
spec="."
[ -n "$extras" ] && spec=".[$extras]"
echo "installing $spec into $venv (TensorFlow takes a few minutes the first time)"
"$venv/bin/python" -m pip install --quiet -e "$spec"
echo "$want_hash" > "$venv/.installed"
