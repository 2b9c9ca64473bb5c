#!/usr/bin/env bash
# The README's main command, the rung-3 recipe and the self-test under each OpenBLAS kernel the CPU
# can run (and the CPU's own pick), one line per run: the verdict line with its max/mean digits.
# Every line of one command must carry the same digits; any exit other than 0 is printed.
#   bash tools/kernel_matrix.sh [VENV]        (default .venv; about 5 minutes per kernel on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
kernels=("" Prescott)  # Zen is in the acceptance list; this OpenBLAS runs it as Haswell
grep -qw avx2 /proc/cpuinfo && kernels+=(Haswell Zen)
grep -qw avx512f /proc/cpuinfo && kernels+=(SkylakeX)
receipts=$(mktemp -d)
trap 'rm -rf "$receipts"' EXIT
status=0
for kernel in "${kernels[@]}"; do
  for command in "--recipe native-text" "--recipe kquant-target-plus-dflash" "selftest"; do
    # shellcheck disable=SC2086
    output=$(OPENBLAS_CORETYPE="$kernel" "$venv/bin/qualify" $command --receipts "$receipts" 2>&1)
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    line=$(grep -m1 -E "QUALIFIED|selftest (passed|FAILED)|refused|Error" <<<"$output" | cut -c1-160)
    printf '%-9s %-40s rc=%s  %s\n' "${kernel:-default}" "$command" "$rc" "$line"
  done
done
exit "$status"
