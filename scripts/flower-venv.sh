#!/usr/bin/env bash
# Creates or reuses Flower's own virtualenv (.venv-flower) for the side-by-side bench
# (tools/bench/flower_secagg.py, `make bench-flower`). Flower and TensorFlow 2.15 do not share
# one environment; the pins are tools/bench/requirements-flower.txt. Reused as it is while that
# file and this script are unchanged (a hash in .venv-flower/.installed).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-flower
requirements=tools/bench/requirements-flower.txt
want_hash="$(cat "$requirements" "$0" | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$want_hash" ]; then
  echo "reusing $venv (requirements unchanged)"
  exit 0
fi
py=""
for cand in "${PYTHON:-}" python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11.*/bin/python3.11; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && { py="$cand"; break; }
done
[ -n "$py" ] || { echo "error: the Flower bench needs Python 3.11 (set PYTHON=/path/to/python3.11)." >&2; exit 1; }
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
echo "$want_hash" > "$venv/.installed"
echo "created $venv with $("$venv/bin/python" -c 'import flwr; print("flwr", flwr.__version__)')"
