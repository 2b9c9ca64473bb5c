#!/usr/bin/env bash
# The numpy range pyproject.toml states ("numpy>=LOW,<HIGH") is a tested one: the main job
# (qualify --recipe native-text --reference-once) runs from the wheel in two throwaway venvs, one
# on numpy LOW exactly and one on the newest numpy pip resolves below HIGH, each passing its
# known-answer checks, and tools/same_numbers.py finds the same digits as the checkout's run.
# Usage: bash tools/numpy_range.sh   (0: both ran and matched; non-zero otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
started=$SECONDS
range="$(grep -o '"numpy>=[0-9.]*,<[0-9.]*"' pyproject.toml | tr -d '"')"
low="${range#numpy>=}"; low="${low%%,*}"
[ -n "$low" ] || { echo "numpy_range.sh: pyproject.toml states no numpy>=LOW,<HIGH range" >&2; exit 2; }
work="$(mktemp -d)"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
# Every other pin stays the tested set's; only numpy moves.
grep -v '^numpy==' constraints.txt > "$work/constraints.txt"
"$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps -w "$work/dist" . >/dev/null 2>&1
# The checkout's digits: the offline-verifier step's run when `make test` left one, else a new run.
if compgen -G "out/offline-receipts/2*" >/dev/null; then
  mkdir "$work/checkout" && cp -r "$(ls -d out/offline-receipts/2* | tail -n 1)" "$work/checkout/"
else
  "$VENV/bin/qualify" --recipe native-text --reference-once --receipts "$work/checkout" >/dev/null
fi
for spec in "numpy==$low" "$range"; do
  name="${spec//[^0-9A-Za-z.]/_}"
  python3 -m venv "$work/$name"
  "$work/$name/bin/pip" install -q --disable-pip-version-check -c "$work/constraints.txt" \
    "$work"/dist/trust_ladder-*.whl "$spec" >/dev/null 2>"$work/pip.log" \
    || { grep -v '^WARNING: Location' "$work/pip.log" >&2; exit 1; }
  version="$("$work/$name/bin/python" -c 'import numpy; print(numpy.__version__)')"
  (cd "$work" && "$name/bin/qualify" --recipe native-text --reference-once --receipts "$work/r-$name" >/dev/null)
  "$VENV/bin/python" tools/same_numbers.py "$work"/checkout/2* "$work/r-$name"/2*
  echo "numpy_range.sh: numpy $version ($spec): QUALIFIED, the checkout's digits"
done
echo "numpy_range.sh: $((SECONDS - started)) s"
