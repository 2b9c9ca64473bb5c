#!/usr/bin/env python3
"""Check that two receipts of the same recipe carry the same numbers, digit for digit.

tools/test.sh runs ``qualify --recipe native-text`` from the checkout and from an installed wheel
outside it; the installed harness must compute exactly what the checkout computes. Compared per
sample: the payload, logit-block and generated-token digests and the logit deltas; and the
verdict. Timings differ between runs and are not compared.

    python tools/same_numbers.py RECEIPT_A RECEIPT_B   # exit 0 same, 1 differ, 2 unreadable
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SAMPLE_FIELDS = ("repetition", "payload_sha256", "handoff_logit_block_sha256", "cold_logit_block_sha256",
                 "handoff_generated_token_sha256", "cold_generated_token_sha256", "max_abs", "mean_abs",
                 "token_agreement_rate", "error")
SUMMARY_FIELDS = ("status", "verdict", "lane", "recipe", "identity_sha256", "samples")


def numbers(receipt: Path) -> dict[str, Any]:
    """The compared fields of a receipt's summary and of each sample record, by file name."""
    summary = json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))
    found: dict[str, Any] = {"validation-summary.json": {name: summary.get(name) for name in SUMMARY_FIELDS}}
    for path in sorted((receipt / "samples").glob("sample-*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        found[f"samples/{path.name}"] = {name: record.get(name) for name in SAMPLE_FIELDS}
    return found


def differences(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """One line per file or field whose value differs between the two receipts."""
    lines = [f"{name}: only in one receipt" for name in sorted(set(first) ^ set(second))]
    for name in sorted(set(first) & set(second)):
        lines += [f"{name}: {field}: {first[name][field]!r} != {second[name][field]!r}"
                  for field in first[name] if first[name][field] != second[name][field]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("same_numbers: expected two receipt directories", file=sys.stderr)
        return 2
    try:
        first, second = (numbers(Path(arg)) for arg in args)
    except (OSError, ValueError) as exc:
        print(f"same_numbers: cannot read a receipt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    found = differences(first, second)
    for line in found:
        print(f"same_numbers: {line}", file=sys.stderr)
    if not found:
        print(f"same_numbers: {len(first) - 1} samples and the verdict are identical in both receipts")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
