"""What signing and verifying a receipt cost against the qualification that writes it.

Runs one native-text qualification on the default lane in-process (its receipt signed with a
throwaway key in a temporary config directory, never the operator's), times it, then times
``sign_statement`` (build and sign the statement over the files the manifest already hashed:
what ``finalize`` adds besides hashing the manifest itself) and
``authenticate_receipt`` (what ``qualify receipts verify`` does per receipt) on that receipt,
best of N each. Prints both as fractions of the qualification's wall time, measured in the same
run; the last line is the headline, signing's share.

Usage: python bench/signing.py [N] (N repeats of each timing, default 50)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any


def best_seconds(action: Callable[[], Any], repeats: int) -> float:
    """Best wall time of ``repeats`` calls (the least disturbed by the rest of the machine)."""
    return min(timeit.repeat(action, repeat=repeats, number=1))


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    with tempfile.TemporaryDirectory(prefix="bench-signing-") as scratch:
        os.environ["XDG_CONFIG_HOME"] = str(Path(scratch) / "config")  # a throwaway signing key
        from qualify.archive.attestation import ENVELOPE, sign_statement
        from qualify.archive.keys import default_trust_path, ensure_signing_key, load_signing_key, load_trust
        from qualify.archive.verify import authenticate_receipt
        from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions

        ensure_signing_key(announce=lambda line: None)  # made before the clock starts, as an operator's exists
        run = QualificationRun(RunOptions(recipe="native-text", receipts=Path(scratch) / "archive",
                                          command_line=["python", "bench/signing.py"]))
        started = time.perf_counter()
        outcomes = [run.step(label) for label in STEP_LABELS]
        run.close()
        wall = time.perf_counter() - started
        receipt = run.receipt_path
        if receipt is None or not all(outcome.passed for outcome in outcomes):
            print("bench/signing.py: the qualification did not pass: "
                  + "; ".join(f"{o.label}: {o.message}" for o in outcomes if not o.passed), file=sys.stderr)
            return 1
        key, trust = load_signing_key(), load_trust(default_trust_path())
        check = authenticate_receipt(receipt, trust)
        if check.state != "verified":
            print(f"bench/signing.py: the run's receipt is {check.state}: {check.problems}", file=sys.stderr)
            return 1
        envelope = json.loads((receipt / ENVELOPE).read_bytes())
        predicate = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
        files = [path for path in receipt.rglob("*") if path.is_file()]
        subjects = [(path.relative_to(receipt).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest())
                    for path in files if path.name != ENVELOPE]
        if sign_statement(subjects, predicate, key) != (receipt / ENVELOPE).read_bytes():
            print("bench/signing.py: re-signing the receipt did not give its envelope back", file=sys.stderr)
            return 1
        size = sum(path.stat().st_size for path in files)
        sign_s = best_seconds(lambda: sign_statement(subjects, predicate, key), repeats)
        verify_s = best_seconds(lambda: authenticate_receipt(receipt, trust), repeats)
        load_s = best_seconds(load_signing_key, repeats)

    print(f"qualification wall time: {wall:.3f} s ({len(run.records)} handoffs); receipt: {len(files)} files, "
          f"{size / 1024:.1f} KiB")
    print(f"  load signing key          {load_s * 1e3:8.3f} ms  ({load_s / wall:.2e} of the run)")
    print(f"  sign_statement            {sign_s * 1e3:8.3f} ms  ({sign_s / wall:.2e} of the run)")
    print(f"  authenticate_receipt      {verify_s * 1e3:8.3f} ms  ({verify_s / wall:.2e} of the run)")
    print(f"best of {repeats} each; verifying one receipt: {verify_s / wall:.2e} of the run that wrote it")
    print(f"signing_overhead: {(sign_s + load_s) / wall:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
