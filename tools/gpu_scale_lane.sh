#!/usr/bin/env bash
# On the GPU machine (repo root, .whl carried, `source tools/device_env.sh` done): calibrate the
# llama3-8b-shape-pd lane through bench/gpu_scale.py, freeze its identity from that basis receipt,
# regenerate the sealed data, then qualify it and run one fault. Everything lands in $OUT.
set -uo pipefail
OUT="${OUT:?set OUT}"
python3 bench/gpu_scale.py --calibrate --receipts receipts --json "$OUT/calibrate.json" \
    > "$OUT/calibrate.txt" 2>&1 || { tail -5 "$OUT/calibrate.txt"; exit 1; }
basis=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['receipt'].split('/')[-1])" "$OUT/calibrate.json")
python3 tools/freeze_identity.py --lane llama3-8b-shape-pd \
    --basis "receipt://$basis/command.log" --replace > "$OUT/freeze.txt" 2>&1 \
    && python3 tools/freeze_identity.py --write-sealed >> "$OUT/freeze.txt" 2>&1 || { cat "$OUT/freeze.txt"; exit 1; }
mkdir -p "$OUT/lane"
for name in ${QUALIFY_RUNS:-qualify}; do
  python3 bench/gpu_scale.py --receipts receipts --json "$OUT/lane/$name.json" > "$OUT/lane/$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/lane/$name.txt"
done
python3 bench/gpu_scale.py --fault kv-ulp --receipts receipts --json "$OUT/lane/fault-kv-ulp.json" \
    > "$OUT/lane/fault-kv-ulp.txt" 2>&1
echo "fault rc=$?" >> "$OUT/lane/fault-kv-ulp.txt"
mv "$OUT"/calibrate.* "$OUT"/freeze.txt "$OUT/lane/"
cp contracts/llama3-8b-shape-pd-identity-v1.json qualify/contract/sealed_data.py "$OUT/lane/"
runs=$(for f in "$OUT"/lane/*.json; do python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('receipt','').split('/')[-1])" "$f" 2>/dev/null; done | grep -v '^$' | sort -u)
tar czf "$OUT/lane.tgz" -C "$OUT" lane $(for r in $runs; do echo "-C $PWD receipts/$r"; done)
grep -H "verdict:\|gpu_scale_overhead_ratio\|rc=\|sample [0-9]:\|KV above" "$OUT"/lane/*.txt
rm -rf "$OUT/lane"
for f in $runs; do echo "$f"; done
