#!/usr/bin/env python3
"""Stop a real run's producer and see what the run does: the SIGSTOP drill.

Starts ``qualify --recipe R [ARGS]`` and finds its producer process. During handoff 1 it stops
the producer for ``--recover-s`` seconds and resumes it, which the run must record as a stall.
During handoff ``--stop-at`` it stops the producer for good, and the run must fail within its
deadline with exit 1, a receipt that verifies (signed by the operator's key, every file as
signed), and no producer left behind. Prints one line per
fact, and its headline last as ``stall_drill_stop_to_exit_s: SECONDS``.

    python tools/stall_drill.py --receipts out/drill [--recover-s 4] [--stop-at 2] [-- QUALIFY ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qualify.archive.keys import default_trust_path, load_trust
from qualify.archive.verify import ReceiptCheck, authenticate_receipt

# How long the drill waits for a step before giving up (a cold recompute on a slow CPU included).
STEP_LIMIT_S = 900.0


def _producers(pid: int) -> list[int]:
    """The run's child processes that lead a session of their own: its producer (started in a new
    session), not the consumer's forked child that computes cold branches ahead."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.extend(int(child) for child in (task / "children").read_text().split())
    return [child for child in found if _session_of(child) == child]


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def _command_log(archive: Path) -> str:
    logs = sorted(archive.rglob("command.log"))
    return logs[0].read_text(encoding="utf-8") if logs else ""


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + STEP_LIMIT_S
    while not predicate():
        if time.monotonic() > give_up:
            raise SystemExit(f"stall_drill: {what} not reached within {STEP_LIMIT_S:g} s")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _check(receipt: Path) -> ReceiptCheck:
    """The receipt as ``qualify receipts verify`` judges it, under the operator's trust file
    (the run made the key and that file if there were none)."""
    trust_path = default_trust_path()
    return authenticate_receipt(receipt, load_trust(trust_path) if trust_path.exists() else None)


def drill(archive: Path, recipe: str, recover_s: float, stop_at: int, extra: list[str]) -> dict[str, object]:
    """Run the drill; returns what it saw (see the module docstring)."""
    command = [sys.executable, "-m", "qualify.interfaces.cli", "--recipe", recipe, "--receipts", str(archive), *extra]
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: "step reference computed: ok" in _command_log(archive), "the cold recompute")
        producers = _producers(run.pid)
        if len(producers) != 1:
            raise SystemExit(f"stall_drill: expected one producer process, found {producers}")
        producer = producers[0]
        if recover_s > 0:
            time.sleep(0.5)  # inside handoff 1's prefill
            os.killpg(producer, signal.SIGSTOP)
            time.sleep(recover_s)
            os.killpg(producer, signal.SIGCONT)
        _wait_for(lambda: f"step handoff {stop_at - 1}/3: ok" in _command_log(archive), f"handoff {stop_at - 1}")
        time.sleep(0.5)
        os.killpg(producer, signal.SIGSTOP)
        stopped = time.monotonic()
        output, _ = run.communicate(timeout=STEP_LIMIT_S)
        stop_to_exit_s = time.monotonic() - stopped
    finally:
        if run.poll() is None:
            run.kill()
    receipts = sorted(path for path in archive.iterdir() if path.is_dir())
    log = (receipts[0] / "command.log").read_text(encoding="utf-8") if receipts else ""
    checked = _check(receipts[0]) if receipts else None
    return {
        "exit_status": run.returncode,
        "stop_to_exit_s": round(stop_to_exit_s, 2),
        "producer_left_behind": _alive(producer),
        "receipts": [path.name for path in receipts],
        "receipt_state": f"{checked.state} ({checked.status})" if checked else None,
        "receipt_problems": checked.problems if checked else ["no receipt"],
        "deadlines": next((line.split(": ", 1)[1] for line in log.splitlines() if "producer deadlines" in line), None),
        "stall_lines": [line.split("Z ", 1)[-1] for line in log.splitlines() if "producer stalled" in line],
        "samples": {path.stem: json.loads(path.read_text()) for path in sorted((receipts[0] / "samples").glob("*.json"))}
        if receipts else {},
        "last_output_line": output.strip().splitlines()[-1] if output.strip() else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=Path, required=True, help="a new, empty receipt archive")
    parser.add_argument("--recipe", default="native-text")
    parser.add_argument("--recover-s", type=float, default=4.0, help="the recovered stall in handoff 1 (0: none)")
    parser.add_argument("--stop-at", type=int, choices=(2, 3), default=2, help="the handoff the producer is stopped in")
    parser.add_argument("--json", type=Path, help="also write what the drill saw here")
    parser.add_argument("extra", nargs="*", help="further qualify arguments (after --)")
    args = parser.parse_args()
    args.receipts.mkdir(parents=True, exist_ok=True)
    if any(args.receipts.iterdir()):
        raise SystemExit(f"stall_drill: --receipts {args.receipts} is not empty")
    seen = drill(args.receipts, args.recipe, args.recover_s, args.stop_at, args.extra)
    if args.json is not None:
        args.json.write_text(json.dumps(seen, indent=1) + "\n")
    samples = seen["samples"]
    assert isinstance(samples, dict)
    for key in ("exit_status", "producer_left_behind", "receipts", "receipt_state", "receipt_problems", "deadlines",
                "stall_lines"):
        print(f"{key}: {seen[key]}")
    for name, sample in samples.items():
        print(f"{name}: producer_stall_s {sample.get('producer_stall_s')}, error {sample.get('error')}")
    print(f"stall_drill_stop_to_exit_s: {seen['stop_to_exit_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
