"""Does the compact engine's prefill reproduce across engine instances and fresh processes?

Each child process sets up the ``llama3-8b-shape-pd`` lane as ``bench/gpu_scale.py`` does (weights,
producer and consumer engines, the same warm-up), then prefills the recipe prompt's 2047 positions
on both engines and compares their K/V bit for bit, layer by layer. The parent runs ``--processes``
fresh children and reports how many disagreed, and where. (GPU only.)

    python bench/prefill_reproducibility.py [--processes 12] [--env NAME=VALUE ...]

Last line: ``prefill_mismatch_rate: <mismatching processes / processes>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def child() -> dict[str, object]:
    """One fresh process: the lane's engines, warmed up as the bench does, then both prefills."""
    import importlib.util

    from qualify.contract.lanes import LLAMA3_8B_SHAPE_LANE, lane_spec
    from qualify.engines.factory import build_consumer, build_producer

    spec = importlib.util.spec_from_file_location("gpu_scale", REPO_ROOT / "bench" / "gpu_scale.py")
    assert spec is not None and spec.loader is not None
    gpu_scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_scale)
    consumer = build_consumer(lane_spec(LLAMA3_8B_SHAPE_LANE))
    producer = build_producer(LLAMA3_8B_SHAPE_LANE, consumer.spec.mode)
    gpu_scale.warm_up(consumer, producer)
    differing = gpu_scale.prefill_differences(consumer, producer)
    return {"equal": not differing, "differing": differing[:4]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=12)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return 0
    env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
    mismatches = 0
    for index in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              check=False)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            print(f"process {index + 1}: failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
            return 1
        result = json.loads(lines[-1])
        mismatches += not result["equal"]
        print(f"process {index + 1}: " + ("producer and consumer prefill KV equal" if result["equal"]
                                          else f"DIFFER: {result['differing']}"))
    print(f"environment overrides: {args.env or 'none'}")
    print(f"prefill_mismatch_rate: {mismatches}/{args.processes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
