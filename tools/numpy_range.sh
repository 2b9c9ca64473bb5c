#!/usr/bin/env bash
# The numpy range pyproject.toml states ("numpy>=LOW,<HIGH") is a tested one: the main job
# (qualify --recipe native-text --reference-once) runs on numpy LOW exactly and on the newest numpy
# pip resolves below HIGH, each passing its known-answer checks, and tools/same_numbers.py finds
# the same digits as the checkout's run. Only numpy moves: each numpy is installed alone into a
# folder put first on PYTHONPATH in front of the tested venv (seconds, where a venv per numpy took
# minutes); the wheel outside the checkout is make test's own step.
# Usage: bash tools/numpy_range.sh   (0: both ran and matched; non-zero otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
started=$SECONDS
range="$(grep -o '"numpy>=[0-9.]*,<[0-9.]*"' pyproject.toml | tr -d '"')"
low="${range#numpy>=}"; low="${low%%,*}"
[ -n "$low" ] || { echo "numpy_range.sh: pyproject.toml states no numpy>=LOW,<HIGH range" >&2; exit 2; }
work="$(mktemp -d)"
runs=()
cleanup() {  # on any exit: stop runs still going, remove the work folder. Under `set -e` a failing
  # command in an EXIT trap becomes the script's exit status, so each one here may fail harmlessly;
  # its stderr goes nowhere, so bash's notices of the runs it stops ("Terminated", "No record of
  # process") never follow the one-line refusal.
  local run
  for run in "${runs[@]}"; do
    if kill "$run"; then wait "$run" || true; fi
  done
  chmod -R u+w "$work" || true
  rm -rf "$work"
} 2>/dev/null
trap cleanup EXIT
# The checkout's digits: the offline-verifier step's run when `make test` left one, else a new run.
if compgen -G "out/offline-receipts/2*" >/dev/null; then
  mkdir "$work/checkout" && cp -r "$(ls -d out/offline-receipts/2* | tail -n 1)" "$work/checkout/"
else
  "$VENV/bin/qualify" --recipe native-text --reference-once --receipts "$work/checkout" >/dev/null
fi
# Both runs at once: each is mostly one process at a time (the consumer waits while its producer
# prefills), so side by side they share the two cores.
specs=("numpy==$low" "$range") names=() versions=()
for spec in "${specs[@]}"; do
  name="${spec//[^0-9A-Za-z.]/_}"
  names+=("$name")
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$work/$name" "$spec" \
    >/dev/null 2>"$work/pip.log" || { cat "$work/pip.log" >&2; exit 1; }
  versions+=("$(PYTHONPATH="$work/$name" "$VENV/bin/python" -c 'import numpy; print(numpy.__version__)')")
  case "$(PYTHONPATH="$work/$name" "$VENV/bin/python" -c 'import numpy; print(numpy.__file__)')" in
    "$work/$name"/*) ;;
    *) echo "numpy_range.sh: numpy $spec did not shadow the venv's numpy" >&2; exit 1 ;;
  esac
  PYTHONPATH="$work/$name" "$VENV/bin/qualify" --recipe native-text --reference-once --receipts "$work/r-$name" >/dev/null &
  runs+=($!)
done
for index in "${!specs[@]}"; do
  spec="${specs[$index]}" name="${names[$index]}"
  wait "${runs[$index]}" || { echo "numpy_range.sh: the main job on numpy $spec failed (exit $?)" >&2; exit 1; }
  "$VENV/bin/python" tools/same_numbers.py "$work"/checkout/2* "$work/r-$name"/2*
  echo "numpy_range.sh: numpy ${versions[$index]} ($spec): QUALIFIED, the checkout's digits"
done
echo "numpy_range.sh: $((SECONDS - started)) s"
