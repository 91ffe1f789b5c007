#!/usr/bin/env bash
# `make test`: runs one stack's test selection in two phases, with one exit status.
#
#   scripts/test.sh <python> <tests...>
#
# 1. Everything not marked `multiprocess` (it runs inside pytest's process) on
#    $TEST_WORKERS pytest-xdist workers (default 2, one per core; 1 runs it
#    serially in this process). `--dist loadfile` sends a whole test file to one
#    worker: a file's module-scoped fixtures (servers, trained models) are built
#    once, as without workers. Files go out in collection order
#    (`--no-loadscope-reorder`), longest first (tests/conftest.py).
# 2. The `multiprocess` tests (loopback clusters of several processes, whose
#    deadlines assume they have the machine) one after the other, without workers.
#
# The exit status is pytest's if a phase failed (the first failing phase's).
# pytest's "no tests collected" (5) is fine for one phase (tf221's selection has
# no cluster tests) but is returned when neither phase collected a test.
set -uo pipefail
cd "$(dirname "$0")/.."
python="$1"
shift
workers="${TEST_WORKERS:-2}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: TEST_WORKERS=$workers is not a number of workers; use 1 (serial) or more, e.g. TEST_WORKERS=2." >&2
  exit 2
fi

parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)

"$python" -m pytest "$@" -m "not multiprocess" "${parallel[@]}"
in_process=$?
"$python" -m pytest "$@" -m multiprocess
clusters=$?

for status in "$in_process" "$clusters"; do
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
done
if [ "$in_process" -eq 5 ] && [ "$clusters" -eq 5 ]; then exit 5; fi
exit 0
