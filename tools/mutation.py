#!/usr/bin/env python3
"""The mutation gate: mutmut over the judging core, the comparers, the wire and manifest checks,
identity validation, receipt verification and its signature check, scored per group against
tools/mutation.toml.

mutmut (configured in pyproject.toml's ``[tool.mutmut]``) runs in a copy of the working tree, so
the checkout gets no ``mutants/`` directory. A group's score is killed / (mutants - equivalent):
a mutant no selected test runs counts as surviving. The equivalent mutants are the reviewed
entries of tools/mutation.toml, each matched by its function and its exact changed lines (never
by mutmut's number, which moves when the function changes); an entry that matches no mutant is
stale and fails the gate, so the list cannot silently excuse a different mutant.

    python tools/mutation.py                        # the gate: exit 1 below a group's floor
    python tools/mutation.py --survivors out/s.json # also write every survivor's diff

Each group has a committed floor, the score the tree has reached (raised as tests land, never
lowered), and all share a target that the report says each group has or has not reached. The last
line is ``mutation_score: <lowest group's score, in percent>``. Exit 0 at or above every floor,
1 below one, 2 when the run or the gate file cannot be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GATE = ROOT / "tools" / "mutation.toml"
# mutmut's exit codes for a mutant's test run (mutmut.stats.status_by_exit_code, 3.8): the ones
# that detect the mutant. Anything else (survived, no tests, suspicious, segfault, not checked)
# is a mutant the tests did not catch.
# 37 is a mutant strict mypy rejects (tools/mutation_typecheck.py): CI's type check would refuse it.
DETECTED_EXIT_CODES = {
    1: "killed",
    3: "killed",
    37: "caught by type check",
    36: "timeout",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
}


class GateError(Exception):
    """The run or the gate's own file cannot be trusted (exit 2)."""


@dataclass(frozen=True)
class Equivalent:
    function: str
    removed: tuple[str, ...]
    added: tuple[str, ...]
    reason: str


@dataclass
class GroupScore:
    name: str
    mutants: int = 0
    equivalent: int = 0
    detected: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def score(self) -> float:
        counted = self.mutants - self.equivalent
        return 100.0 * self.detected / counted if counted else 0.0


def load_gate(path: Path) -> tuple[float, dict[str, float], dict[str, list[str]], list[Equivalent]]:
    """The target, each group's floor and source files, and the equivalent mutants, checked."""
    try:
        gate = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise GateError(f"{path.name}: cannot read: {error}") from None

    def percentage(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 100

    target = gate.get("target")
    if not percentage(target):
        raise GateError(f"{path.name}: target: expected a percentage in (0, 100]")
    groups = gate.get("groups")
    if (
        not isinstance(groups, dict)
        or not groups
        or not all(isinstance(files, list) and files and all(isinstance(f, str) for f in files) for files in groups.values())
    ):
        raise GateError(f"{path.name}: groups: expected a table of group -> non-empty list of source files")
    floors = gate.get("floors")
    if not isinstance(floors, dict) or set(floors) != set(groups) or not all(map(percentage, floors.values())):
        raise GateError(f"{path.name}: floors: expected a percentage in (0, 100] for each group, and only those")
    equivalents = []
    for index, entry in enumerate(gate.get("equivalent", [])):
        texts_ok = all(isinstance(entry.get(key), str) and entry[key].strip() for key in ("function", "reason"))
        lines_ok = all(
            isinstance(entry.get(key), list) and all(isinstance(line, str) for line in entry[key]) for key in ("removed", "added")
        )
        if set(entry) != {"function", "removed", "added", "reason"} or not texts_ok or not lines_ok:
            raise GateError(f"{path.name}: equivalent[{index}]: expected function, removed, added and a reason")
        equivalents.append(Equivalent(entry["function"], tuple(entry["removed"]), tuple(entry["added"]), entry["reason"]))
    return float(target), {name: float(value) for name, value in floors.items()}, groups, equivalents


def copy_tree(destination: Path) -> None:
    """The working tree's tracked and unignored files, as `git ls-files` names them."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def run_mutmut(tree: Path, jobs: int) -> None:
    # One BLAS thread per mutant worker; this interpreter's `python` first on PATH for mutmut's
    # type_check_command (pyproject.toml); the property tests at a tenth of their examples
    # (tests/support/fuzz_budget.py says why).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PATH=path, QUALIFY_MUTATION_RUN="1")
    log = tree / "mutmut.log"
    with log.open("wb") as output:
        done = subprocess.run(
            # mutmut run, its type-check step's slow libcst parse replaced (tools/mutation_typecheck.py)
            [sys.executable, str(ROOT / "tools" / "mutation_typecheck.py"), "mutmut", "run", "--max-children", str(jobs)],
            cwd=tree, env=env, stdout=output, stderr=output,
        )
    if done.returncode != 0:
        # mutmut draws progress with carriage returns; its cause is a pytest FAILED line or its last words.
        lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines()]
        failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
        cause = "; ".join(failed[:3]) or next((line for line in reversed(lines) if line), "no output")
        raise GateError(f"mutmut run exited {done.returncode}: {cause}")


def exit_codes(tree: Path, sources: set[str]) -> dict[str, tuple[str, int | None]]:
    """mutant name -> (its source file, its test run's exit code), from mutmut's .meta files."""
    results: dict[str, tuple[str, int | None]] = {}
    for meta in sorted((tree / "mutants").rglob("*.py.meta")):
        source = meta.relative_to(tree / "mutants").as_posix().removesuffix(".meta")
        if source not in sources:
            continue
        try:
            recorded = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
        except (OSError, ValueError, KeyError) as error:
            raise GateError(f"{meta.name}: mutmut's results are unreadable: {error}") from None
        for name, code in recorded.items():
            results[name] = (source, code)
    if not results:
        raise GateError("mutmut produced no mutants: nothing was tested")
    return results


def changed_lines(diff: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    body = [line for line in diff.splitlines() if not line.startswith(("---", "+++", "@@"))]
    return (
        tuple(line[1:].strip() for line in body if line.startswith("-")),
        tuple(line[1:].strip() for line in body if line.startswith("+")),
    )


def function_of(mutant: str) -> str:
    return mutant.rsplit("__mutmut_", 1)[0]


def diffs_of(tree: Path, names: dict[str, str]) -> dict[str, str]:
    """Each named mutant's diff (name -> its source file), from mutmut's own renderer."""
    previous = Path.cwd()
    os.chdir(tree)  # mutmut reads its configuration and mutants/ from the working directory
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        return {name: get_diff_for_mutant(name, path=source) for name, source in names.items()}
    finally:
        os.chdir(previous)


def score(
    tree: Path, groups: dict[str, list[str]], equivalents: list[Equivalent], survivors_out: Path | None
) -> list[GroupScore]:
    group_of = {source: group for group, files in groups.items() for source in files}
    results = exit_codes(tree, set(group_of))
    scores = {group: GroupScore(group) for group in groups}
    if any(code is None for _, code in results.values()):
        raise GateError("mutmut left mutants not checked: its run did not finish")
    undetected = {name: source for name, (source, code) in results.items() if code not in DETECTED_EXIT_CODES}
    # Entries of the scored files only (a --groups run); each must match a mutant mutmut made,
    # detected or not: one matching none names code that is gone or changed.
    scored_modules = {source.removesuffix(".py").replace("/", ".") for source in group_of}
    equivalents = [e for e in equivalents if e.function.rsplit(".", 1)[0] in scored_modules]
    listed = {e.function for e in equivalents}
    diffs = diffs_of(
        tree, {name: source for name, (source, _) in results.items() if name in undetected or function_of(name) in listed}
    )
    candidates = {
        equivalent: [
            name
            for name in diffs
            if function_of(name) == equivalent.function and changed_lines(diffs[name]) == (equivalent.removed, equivalent.added)
        ]
        for equivalent in equivalents
    }
    stale = [equivalent for equivalent, matches in candidates.items() if not matches]
    if stale:
        raise GateError(
            "equivalent entries that match no mutant (the code changed: correct or remove them): "
            + "; ".join(f"{e.function}: {' | '.join(e.added)}" for e in stale)
        )
    from mutmut.stats import status_by_exit_code  # after diffs_of: mutmut reads its config on import

    excused = {name for matches in candidates.values() for name in matches if name in undetected}
    survivors = []
    for name, (source, code) in results.items():
        group = scores[group_of[source]]
        group.mutants += 1
        if code in DETECTED_EXIT_CODES:
            group.detected += 1
            group.outcomes[DETECTED_EXIT_CODES[code]] += 1
        elif name in excused:
            group.equivalent += 1
        else:
            group.outcomes[status_by_exit_code[code]] += 1
            survivors.append({"mutant": name, "file": source, "status": status_by_exit_code[code], "diff": diffs[name]})
    missing = [group.name for group in scores.values() if group.mutants == 0]
    if missing:
        raise GateError(f"groups with no mutants (their files are not mutated): {', '.join(missing)}")
    if survivors_out is not None:
        survivors_out.parent.mkdir(parents=True, exist_ok=True)
        survivors_out.write_text(json.dumps(survivors, indent=1) + "\n", encoding="utf-8")
    return list(scores.values())


def report(scores: list[GroupScore], target: float, floors: dict[str, float]) -> bool:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mutation score per group (target {target:g} %; the gate fails below a group's floor)")
    columns = (
        "group", "mutants", "equivalent", "killed", "type check", "timeout", "survived", "no tests", "other", "score %", "floor %"
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "group" else "right")
    for group in scores:
        shown = {"killed", "caught by type check", "timeout", "survived", "no tests"}
        other = sum(n for status, n in group.outcomes.items() if status not in shown)
        table.add_row(
            group.name,
            str(group.mutants),
            str(group.equivalent),
            str(group.outcomes["killed"]),
            str(group.outcomes["caught by type check"]),
            str(group.outcomes["timeout"]),
            str(group.outcomes["survived"]),
            str(group.outcomes["no tests"]),
            str(other),
            f"{group.score:.1f}",
            f"{floors[group.name]:g}",
        )
    Console(width=120).print(table)
    short = [group.name for group in scores if group.score < target]
    print(f"target {target:g} %: " + (f"not reached in {', '.join(short)}" if short else "reached in every group"))
    return all(group.score >= floors[group.name] for group in scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutant workers (default: all cores)")
    parser.add_argument("--survivors", type=Path, help="write every uncaught mutant's diff here (JSON)")
    parser.add_argument("--tree", type=Path, help="an already-run mutmut tree to score (skips the run)")
    parser.add_argument("--gate", type=Path, default=GATE, help="the gate file (default: tools/mutation.toml)")
    parser.add_argument("--groups", help="score only these groups (comma-separated); the gate needs all")
    arguments = parser.parse_args(argv)
    try:
        target, floors, groups, equivalents = load_gate(arguments.gate)
        if arguments.groups:
            chosen = arguments.groups.split(",")
            if unknown := sorted(set(chosen) - set(groups)):
                raise GateError(f"--groups: no such group {', '.join(unknown)} (groups: {', '.join(groups)})")
            groups = {name: groups[name] for name in chosen}
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="mutation-") as scratch:
            tree = arguments.tree
            if tree is None:
                tree = Path(scratch)
                copy_tree(tree)
                run_mutmut(tree, arguments.jobs)
            ran = (
                f"mutmut ran in {time.monotonic() - started:.0f} s with {arguments.jobs} workers"
                if arguments.tree is None
                else "scored an existing run"
            )
            scores = score(tree.resolve(), groups, equivalents, arguments.survivors)
    except GateError as error:
        print(f"mutation: {error}", file=sys.stderr)
        return 2
    passed = report(scores, target, floors)
    lowest = min(scores, key=lambda group: group.score)
    print(f"{ran}; lowest: {lowest.name}; equivalent mutants excused: {sum(g.equivalent for g in scores)}")
    print(f"mutation_score: {lowest.score:.1f}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
