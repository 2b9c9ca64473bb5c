#!/usr/bin/env python3
"""The mutation gate: mutmut over the judging core, the comparers, the wire and manifest checks,
identity validation, receipt verification and its signature check, scored per group against
tools/mutation.toml, logic mutants and message-text mutants apart.

Every mutant is classed from its change, by the standard library's ``ast`` (never by its text):
it is *message text* when all it changes is the words of a prose string literal (one with two or
more words, f-string literal parts included) that is no key (a dict key, a subscript, a compared
operand, a ``case`` value, a ``.get`` key); every other mutant is *logic*. Logic mutants run the unit
tests that reach their function (pyproject.toml's ``[tool.mutmut]`` selection) and are gated at a
floor of at least 99 % per group; message mutants run only the golden-file tests
(``message_tests`` in tools/mutation.toml), which hold the operator's words, and are scored apart.

mutmut runs in a copy of the working tree (the checkout gets no ``mutants/``), in three steps:
write the mutants and class them; run the logic ones (the message ones held back as mutmut's
"skipped"); run the message ones against the golden tests, when those exist. A logic score is
detected / (logic mutants - equivalent). Equivalent mutants are excused by tools/mutation.toml's
rules (a class of change, checked on the ``ast``) or its entries (a function and its exact changed
lines); a rule or entry that matches no mutant is stale and fails the gate, so neither can
silently excuse a different mutant.

    python tools/mutation.py                        # the gate: exit 1 below a group's floor
    python tools/mutation.py --groups signatures    # mutate and score one group only
    python tools/mutation.py --survivors out/s.json # also write every survivor's diff

The last line is ``mutation_score: <lowest group's logic score, in percent>``. Exit 0 at or above
every floor, 1 below one, 2 when the run or the gate file cannot be trusted.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
GATE = ROOT / "tools" / "mutation.toml"
RUN_MUTMUT = ROOT / "tools" / "mutation_typecheck.py"  # mutmut with the gate's type-check mapping and overrides
# The least a logic floor may be: the gate exists to keep the verdict's checks checked.
MINIMUM_LOGIC_FLOOR = 99.0
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
# mutmut's "skipped": a mutant held back from a step, so that mutmut leaves it alone.
HELD_BACK = 34
# mutmut's "no tests".
NO_TESTS = 33
# A logic mutant a rule or entry of the gate file excuses as equivalent: written before the logic
# run, so mutmut never runs it (an equivalent mutant's tests all pass, so its run is the dearest of
# all and can only confirm it survives). Not one of mutmut's codes: it reads as "suspicious" there.
REVIEWED_EQUIVALENT = 38
# What mutmut prints when the selected tests reach no mutated function (mutmut 3.8, run_stats_collection).
NO_TEST_REACHES_A_MUTANT = "could not find any test case for any mutant"
# Written into the tree after a run: which tests the message mutants ran (for --tree).
RUN_RECORD = "mutation-run.json"
MUTANT_FUNCTION = re.compile(r"(?P<function>.+)__mutmut_(?P<which>\d+|orig)")

MutantClass = Literal["logic", "message"]


class GateError(Exception):
    """The run or the gate's own file cannot be trusted (exit 2)."""


# ---------------------------------------------------------------------------------------------
# The gate file


@dataclass(frozen=True)
class Equivalent:
    """A reviewed equivalent mutant: its function and its exact changed lines."""

    function: str
    removed: tuple[str, ...]
    added: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Rule:
    """A reviewed class of equivalent mutants, checked on the change's ``ast`` (RULE_KINDS)."""

    index: int
    kind: str
    groups: tuple[str, ...]
    reason: str
    settings: dict[str, Any]

    def describe(self) -> str:
        return f"rule[{self.index}] ({self.kind}: {', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"


@dataclass(frozen=True)
class Gate:
    target: float
    floors: dict[str, float]
    message_floors: dict[str, float]
    groups: dict[str, list[str]]
    message_tests: list[str]
    rules: list[Rule]
    equivalents: list[Equivalent]


def load_gate(path: Path) -> Gate:
    """The gate file, checked: every field present, typed and known, or a one-line refusal."""
    try:
        gate = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise GateError(f"{path.name}: cannot read: {error}") from None
    known = {"target", "message_tests", "groups", "floors", "message_floors", "rule", "equivalent"}
    if unknown := sorted(set(gate) - known):
        raise GateError(f"{path.name}: unknown field {', '.join(unknown)} (expected {', '.join(sorted(known))})")

    def percentage(value: object, least: float = 0.0) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and least <= value <= 100 and value > 0

    def strings(value: object) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(item, str) and item.strip() for item in value)

    target = gate.get("target")
    if not percentage(target):
        raise GateError(f"{path.name}: target: expected a percentage in (0, 100]")
    groups = gate.get("groups")
    if not isinstance(groups, dict) or not groups or not all(map(strings, groups.values())):
        raise GateError(f"{path.name}: groups: expected a table of group -> non-empty list of source files")
    floors = gate.get("floors")
    if (
        not isinstance(floors, dict)
        or set(floors) != set(groups)
        or not all(percentage(floor, MINIMUM_LOGIC_FLOOR) for floor in floors.values())
    ):
        raise GateError(
            f"{path.name}: floors: expected a logic floor in [{MINIMUM_LOGIC_FLOOR:g}, 100] for each group, and only those"
        )
    message_floors = gate.get("message_floors", {})
    if (
        not isinstance(message_floors, dict)
        or not set(message_floors) <= set(groups)
        or not all(map(percentage, message_floors.values()))
    ):
        raise GateError(f"{path.name}: message_floors: expected a percentage in (0, 100] for some of the groups, and only those")
    message_tests = gate.get("message_tests")
    if not strings(message_tests):
        raise GateError(f"{path.name}: message_tests: expected a non-empty list of test files (the golden-file tests)")
    rules = [load_rule(path.name, index, entry, set(groups)) for index, entry in enumerate(gate.get("rule", []))]
    equivalents = []
    for index, entry in enumerate(gate.get("equivalent", [])):
        texts_ok = all(isinstance(entry.get(key), str) and entry[key].strip() for key in ("function", "reason"))
        lines_ok = all(
            isinstance(entry.get(key), list) and all(isinstance(line, str) for line in entry[key]) for key in ("removed", "added")
        )
        if set(entry) != {"function", "removed", "added", "reason"} or not texts_ok or not lines_ok:
            raise GateError(f"{path.name}: equivalent[{index}]: expected function, removed, added and a reason")
        equivalents.append(Equivalent(entry["function"], tuple(entry["removed"]), tuple(entry["added"]), entry["reason"]))
    assert isinstance(target, (int, float)) and isinstance(message_tests, list)
    return Gate(
        float(target),
        {name: float(value) for name, value in floors.items()},
        {name: float(value) for name, value in message_floors.items()},
        groups,
        list(message_tests),
        rules,
        equivalents,
    )


def load_rule(file: str, index: int, entry: object, groups: set[str]) -> Rule:
    where = f"{file}: rule[{index}]"
    if not isinstance(entry, dict):
        raise GateError(f"{where}: expected a table")
    kind = entry.get("kind")
    if kind not in RULE_KINDS:
        raise GateError(f"{where}: kind: expected one of {', '.join(sorted(RULE_KINDS))}")
    settings = {key: value for key, value in entry.items() if key not in {"kind", "groups", "reason"}}
    required, optional = RULE_SETTINGS[kind]
    if not required <= set(settings) <= required | optional:
        expected = ", ".join([*sorted(required), *(f"optionally {key}" for key in sorted(optional))])
        raise GateError(f"{where}: a {kind} rule takes groups, reason and {expected}")
    rule_groups = entry.get("groups")
    if not isinstance(rule_groups, list) or not rule_groups or not set(rule_groups) <= groups:
        raise GateError(f"{where}: groups: expected a non-empty list of the gate's groups")
    reason = entry.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise GateError(f"{where}: reason: expected why no behaviour tells these mutants from the original")
    if problem := check_rule_settings(kind, settings):
        raise GateError(f"{where}: {problem}")
    return Rule(index, kind, tuple(rule_groups), reason, settings)


# ---------------------------------------------------------------------------------------------
# A mutant's change, from the ast of its function and of mutmut's unmutated copy


@dataclass(frozen=True)
class Change:
    """One place where a mutant differs from its function: the two nodes, and the pairs of their
    enclosing nodes (original, mutant), outermost first."""

    before: Any
    after: Any
    ancestors: tuple[tuple[Any, Any], ...]


Function = ast.FunctionDef | ast.AsyncFunctionDef


def changes_between(original: Function, mutant: Function, lines: list[str]) -> list[Change]:
    """Where ``mutant`` differs from ``original`` (their names aside), each at the innermost node
    that differs; statements whose source lines are the same text are not walked (speed only)."""
    found: list[Change] = []
    for name in ("args", "body", "decorator_list", "returns"):
        _walk(getattr(original, name), getattr(mutant, name), ((original, mutant),), found, lines)
    return found


def _walk(before: Any, after: Any, ancestors: tuple[tuple[Any, Any], ...], found: list[Change], lines: list[str]) -> None:
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            found.append(Change(*ancestors[-1], ancestors[:-1]))
            return
        for one, other in zip(before, after, strict=True):
            _walk(one, other, ancestors, found, lines)
        return
    if type(before) is not type(after):
        found.append(Change(before, after, ancestors))
        return
    if not isinstance(before, ast.AST):
        if repr(before) != repr(after):  # repr, not ==: 0 == False and 1 == 1.0 are changes
            found.append(Change(*ancestors[-1], ancestors[:-1]))
        return
    if isinstance(before, ast.stmt) and _same_text(before, after, lines):
        return
    for name in before._fields:
        _walk(getattr(before, name, None), getattr(after, name, None), (*ancestors, (before, after)), found, lines)


def _same_text(before: ast.stmt, after: ast.stmt, lines: list[str]) -> bool:
    assert before.end_lineno is not None and after.end_lineno is not None
    return (before.col_offset, before.end_col_offset) == (after.col_offset, after.end_col_offset) and lines[
        before.lineno - 1 : before.end_lineno
    ] == lines[after.lineno - 1 : after.end_lineno]


# The class rule. A literal is prose when it holds two or more words (runs of characters with a
# letter) between whitespace: the operator's words, not a key, a codec name, a separator or a format.


def is_prose(text: str) -> bool:
    return sum(any(character.isalpha() for character in word) for word in text.split()) >= 2


def literal_text(node: ast.Constant | ast.JoinedStr) -> str:
    """A string literal's own words: an f-string's literal parts, each placeholder a space."""
    if isinstance(node, ast.JoinedStr):
        return "".join(str(part.value) if isinstance(part, ast.Constant) else " " for part in node.values)
    return str(node.value)


KEY_METHODS = {"get", "pop", "setdefault"}
NAME_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}


def is_key(node: Any, ancestors: tuple[tuple[Any, Any], ...]) -> bool:
    """Whether a literal names or selects something: a dict key, a subscript, an operand of a
    comparison (alone or in a tuple, list or set), a ``case`` value, a ``.get``/``.pop`` key or
    an attribute's name."""
    parents = [pair[0] for pair in reversed(ancestors)]
    while parents and isinstance(parents[0], (ast.Tuple, ast.List, ast.Set)):
        node = parents.pop(0)
    if not parents:
        return False
    parent = parents[0]
    if isinstance(parent, ast.Dict):
        return any(key is node for key in parent.keys)
    if isinstance(parent, ast.Subscript):
        return parent.slice is node
    if isinstance(parent, (ast.Compare, ast.MatchValue)):
        return True
    if isinstance(parent, ast.Call) and parent.args:
        if isinstance(parent.func, ast.Attribute) and parent.func.attr in KEY_METHODS:
            return parent.args[0] is node
        if isinstance(parent.func, ast.Name) and parent.func.id in NAME_BUILTINS:
            return len(parent.args) > 1 and parent.args[1] is node
    return False


def is_message_change(change: Change) -> bool:
    """A change of a prose string literal's words, that literal being no key."""
    before, after = change.before, change.after
    if not (isinstance(before, ast.Constant) and isinstance(after, ast.Constant)):
        return False
    if type(before.value) is not str or type(after.value) is not str:
        return False
    literal: ast.Constant | ast.JoinedStr = before
    ancestors = change.ancestors
    if ancestors and isinstance(ancestors[-1][0], ast.JoinedStr):  # an f-string's literal part
        literal, ancestors = ancestors[-1][0], ancestors[:-1]
    return is_prose(literal_text(literal)) and not is_key(literal, ancestors)


def class_of(changes: list[Change]) -> MutantClass:
    return "message" if changes and all(map(is_message_change, changes)) else "logic"


# ---------------------------------------------------------------------------------------------
# Equivalence rules: each kind a class of change, checked on the ast; the gate file's rules set
# their parameters and give the reason. Expressions in a rule are Python source, compared as ast.


def _expression(text: str) -> str:
    return ast.dump(ast.parse(text, mode="eval").body)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _calls(callee: str, node: Any) -> bool:
    """Whether ``node`` is a call of ``callee`` (a name, or the end of a dotted name: ``apply``
    matches ``transform.apply``)."""
    if not isinstance(node, ast.Call):
        return False
    name = _dotted(node.func)
    return name == callee or name.endswith("." + callee)


def _sites(changes: list[Change]) -> Iterator[tuple[Any, Any, tuple[tuple[Any, Any], ...]]]:
    """Each node pair that encloses every change, innermost first, with its own ancestors."""
    first = changes[0]
    chain = (*first.ancestors, (first.before, first.after))
    for depth in range(len(chain) - 1, -1, -1):
        original = chain[depth][0]
        if all(
            change.before is original or any(pair[0] is original for pair in change.ancestors) for change in changes
        ):
            yield chain[depth][0], chain[depth][1], chain[:depth]


def _argument(call: ast.Call, keyword: str | None, position: int | None) -> tuple[ast.expr | None, str]:
    """The call's argument (or None where absent) and the dump of everything else in the call."""
    if keyword is not None:
        value = next((k.value for k in call.keywords if k.arg == keyword), None)
        rest = [ast.dump(k) for k in call.keywords if k.arg != keyword] + [ast.dump(a) for a in call.args]
    else:
        assert position is not None
        value = call.args[position] if position < len(call.args) else None
        rest = [ast.dump(a) for i, a in enumerate(call.args) if i != position] + [ast.dump(k) for k in call.keywords]
    return value, ast.dump(call.func) + "|" + "|".join(rest)


def match_argument(rule: dict[str, Any], changes: list[Change], function: ast.AST) -> bool:
    """One argument of a call changed, and nothing else: from ``original`` (when given) to one of
    ``becomes`` (an expression, or "dropped")."""
    for original, mutant, _ in _sites(changes):
        if not (_calls(rule["call"], original) and isinstance(mutant, ast.Call)):
            continue
        before, rest_before = _argument(original, rule.get("keyword"), rule.get("position"))
        after, rest_after = _argument(mutant, rule.get("keyword"), rule.get("position"))
        if before is None or rest_before != rest_after:
            return False
        if "original" in rule and ast.dump(before) != _expression(rule["original"]):
            return False
        became = "dropped" if after is None else ast.dump(after)
        return any(became == (option if option == "dropped" else _expression(option)) for option in rule["becomes"])
    return False


def match_read_probe(rule: dict[str, Any], changes: list[Change], function: ast.AST) -> bool:
    """``data = f.read(BOUND + 1)`` read one byte past its bound only so that ``len(data) > BOUND``
    (in the same function) can refuse an over-long input: a read of ``BOUND + k`` (k > 1), of
    everything (``read(None)`` or ``read()``) refuses the same inputs."""
    for original, mutant, ancestors in _sites(changes):
        if not (_calls("read", original) and isinstance(mutant, ast.Call) and len(original.args) == 1):
            continue
        probe = original.args[0]
        if not (isinstance(probe, ast.BinOp) and isinstance(probe.op, ast.Add) and _is_int(probe.right, 1)):
            return False
        bound = probe.left
        if mutant.args:
            after = mutant.args[0]
            reads_more = (
                isinstance(after, ast.BinOp) and isinstance(after.op, ast.Add) and ast.dump(after.left) == ast.dump(bound)
                and isinstance(after.right, ast.Constant) and type(after.right.value) is int and after.right.value > 1
            ) or (isinstance(after, ast.Constant) and after.value is None)
        else:
            reads_more = True
        statement = ancestors[-1][0] if ancestors else None
        if not (reads_more and isinstance(statement, ast.Assign) and statement.value is original):
            return False
        if len(statement.targets) != 1 or not isinstance(statement.targets[0], ast.Name):
            return False
        checked = f"len({statement.targets[0].id}) > {ast.unparse(bound)}"
        return any(
            isinstance(node, ast.Compare) and ast.dump(node) == _expression(checked) for node in ast.walk(function)
        )
    return False


def _is_int(node: ast.expr, value: int) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == value


def match_always_allocated(rule: dict[str, Any], changes: list[Change], function: ast.AST) -> bool:
    """``buffer = <call> if TEST else None`` became ``<call> if (TEST) or True else None``: a scratch
    buffer allocated also where it was not needed."""
    for original, mutant, _ in _sites(changes):
        if not (isinstance(original, ast.IfExp) and isinstance(mutant, ast.IfExp)):
            continue
        if not _calls(rule["call"], original.body) or ast.dump(original.orelse) != _expression("None"):
            return False
        always = ast.BoolOp(op=ast.Or(), values=[original.test, ast.Constant(value=True)])
        return (ast.dump(mutant.test), ast.dump(mutant.body), ast.dump(mutant.orelse)) == (
            ast.dump(always), ast.dump(original.body), ast.dump(original.orelse)
        )
    return False


RULE_KINDS: dict[str, Callable[[dict[str, Any], list[Change], ast.AST], bool]] = {
    "argument": match_argument,
    "read-probe": match_read_probe,
    "always-allocated": match_always_allocated,
}
# Each kind's settings: (required, optional).
RULE_SETTINGS: dict[str, tuple[set[str], set[str]]] = {
    "argument": ({"call", "becomes"}, {"keyword", "position", "original"}),
    "read-probe": (set(), set()),
    "always-allocated": ({"call"}, set()),
}


def check_rule_settings(kind: str, settings: dict[str, Any]) -> str | None:
    """What is wrong with a rule's settings, or None."""
    if "call" in settings and not (isinstance(settings["call"], str) and settings["call"].strip()):
        return "call: expected the callee's name (a name or the end of a dotted name)"
    if kind != "argument":
        return None
    if ("keyword" in settings) == ("position" in settings):
        return "expected one of keyword (a name) or position (a 0-based index)"
    if "keyword" in settings and not (isinstance(settings["keyword"], str) and settings["keyword"].isidentifier()):
        return "keyword: expected an argument name"
    position = settings.get("position", 0)
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        return "position: expected a 0-based index"
    becomes = settings["becomes"]
    if not isinstance(becomes, list) or not becomes or not all(isinstance(option, str) for option in becomes):
        return 'becomes: expected a non-empty list of expressions or "dropped"'
    for text in [settings.get("original", "None"), *(option for option in becomes if option != "dropped")]:
        try:
            _expression(text)
        except (SyntaxError, TypeError, ValueError):
            return f"{text!r}: expected a Python expression"
    return None


# ---------------------------------------------------------------------------------------------
# Reading mutmut's mutants


@dataclass
class Mutant:
    name: str
    source: str
    group: str
    code: int | None
    kind: MutantClass
    removed: tuple[str, ...]
    added: tuple[str, ...]
    diff: str
    rules: frozenset[int]  # the indexes of the rules its change matches (of its group)

    @property
    def function(self) -> str:
        return self.name.rsplit("__mutmut_", 1)[0]


def meta_path(tree: Path, source: str) -> Path:
    return tree / "mutants" / f"{source}.meta"


def read_codes(tree: Path, source: str) -> dict[str, int | None]:
    meta = meta_path(tree, source)
    try:
        codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GateError(f"{meta.relative_to(tree)}: mutmut's results are unreadable: {error!r}") from None
    if not isinstance(codes, dict) or not all(code is None or isinstance(code, int) for code in codes.values()):
        raise GateError(f"{meta.relative_to(tree)}: mutmut's results are unreadable: exit codes expected")
    return codes


def write_codes(tree: Path, source: str, codes: dict[str, int | None]) -> None:
    """Set these mutants' results in mutmut's .meta file (a held-back mutant is one mutmut skips)."""
    meta = meta_path(tree, source)
    data = json.loads(meta.read_text(encoding="utf-8"))
    data["exit_code_by_key"].update(codes)
    meta.write_text(json.dumps(data, indent=4), encoding="utf-8")


def read_mutants(tree: Path, group_of: dict[str, str], rules: list[Rule]) -> list[Mutant]:
    """Every mutant of the scored files, with its result, its changed lines, its class and the
    rules its change matches (matched here, while each file's ast is at hand)."""
    mutants = []
    for source, group in group_of.items():
        if not meta_path(tree, source).is_file():
            continue
        codes = read_codes(tree, source)
        text = (tree / "mutants" / source).read_text(encoding="utf-8")
        lines = text.splitlines()
        functions = {node.name: node for node in _module_and_class_functions(ast.parse(text))
                     if MUTANT_FUNCTION.fullmatch(node.name)}
        module = source.removesuffix(".py").replace("/", ".")
        for name, code in codes.items():
            local = name.removeprefix(module + ".")
            function = local.rsplit("__mutmut_", 1)[0]
            original, mutant = functions.get(f"{function}__mutmut_orig"), functions.get(local)
            if original is None or mutant is None:
                raise GateError(f"{source}: mutmut's mutated file lacks {local} or its unmutated copy")
            before, after = _function_lines(original, lines), _function_lines(mutant, lines)
            removed, added = changed_lines(before, after)
            changes = changes_between(original, mutant, lines)
            kind = class_of(changes)
            candidates = [rule for rule in rules if group in rule.groups] if kind == "logic" and changes else []
            matching = frozenset(rule.index for rule in candidates if RULE_KINDS[rule.kind](rule.settings, changes, original))
            diff = "\n".join(difflib.unified_diff(before, after, fromfile=source, tofile=source, lineterm=""))
            mutants.append(Mutant(name, source, group, code, kind, removed, added, diff, matching))
    return mutants


def _module_and_class_functions(module: ast.Module) -> Iterator[Function]:
    """The functions defined at module level or in a module-level class's body: where mutmut writes
    its mutants and their unmutated copies. Walking every node of a mutated file instead took as
    long as parsing it (about 15 s for the gate's files); a mutant found nowhere here fails the
    gate (read_mutants), it is never skipped."""
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (child for child in node.body if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _function_lines(node: Function, lines: list[str]) -> list[str]:
    """The function's lines, its mutmut name put back to the function's own (so diffs show only the mutation)."""
    assert node.end_lineno is not None
    own = node.name.rsplit("__mutmut_", 1)[0].rsplit("ǁ", 1)[-1].removeprefix("x_")
    body = lines[node.lineno - 1 : node.end_lineno]
    return [body[0].replace(f"def {node.name}(", f"def {own}(", 1), *body[1:]]


def changed_lines(before: list[str], after: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The lines a mutant removes and adds, stripped, in order."""
    opcodes = difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes()
    changed = [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in opcodes if tag != "equal"]
    return (
        tuple(line.strip() for i1, i2, _, _ in changed for line in before[i1:i2]),
        tuple(line.strip() for _, _, j1, j2 in changed for line in after[j1:j2]),
    )


# ---------------------------------------------------------------------------------------------
# Running mutmut


def copy_tree(project: Path, destination: Path) -> None:
    """The project's tracked and unignored files, as `git ls-files` names them."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=project, check=True, capture_output=True
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as error:
        raise GateError(f"{project}: cannot list its files with git: {error}") from None
    for name in filter(None, listed.split("\0")):
        source = project / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def mutmut(tree: Path, arguments: list[str]) -> tuple[int, str]:
    """``mutmut`` (through tools/mutation_typecheck.py) in ``tree``: its exit code and its output."""
    # One BLAS thread per mutant worker; this interpreter's `python` first on PATH for mutmut's
    # type_check_command (pyproject.toml); the property tests at a tenth of their examples
    # (tests/support/fuzz_budget.py says why); no PYTEST_ variable of a test that runs the gate.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PATH=path, QUALIFY_MUTATION_RUN="1")
    env = {key: value for key, value in env.items() if not key.startswith("PYTEST_")}
    log = tree / "mutmut.log"
    with log.open("ab") as output:
        output.write(f"\n$ mutmut {' '.join(arguments)}\n".encode())
        output.flush()
        command = [sys.executable, str(RUN_MUTMUT), "mutmut", *arguments]
        done = subprocess.run(command, cwd=tree, env=env, stdout=output, stderr=output)
    return done.returncode, log.read_text(encoding="utf-8", errors="replace").rsplit("\n$ mutmut ", 1)[-1]


def failure(step: str, code: int, output: str) -> GateError:
    # mutmut draws progress with carriage returns; its cause is a pytest FAILED line or its last words.
    lines = [line.strip() for line in output.replace("\r", "\n").splitlines()]
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    cause = "; ".join(failed[:3]) or next((line for line in reversed(lines) if line), "no output")
    return GateError(f"mutmut {step} exited {code}: {cause}")


def run_mutmut(tree: Path, arguments: list[str], step: str) -> None:
    code, output = mutmut(tree, arguments)
    if code != 0:
        raise failure(step, code, output)


@dataclass
class RunRecord:
    """What the run did with the message mutants (the golden tests they ran, or why they did not
    run), and how long each step took."""

    message_tests: list[str]
    not_run: str | None
    seconds: dict[str, float] = field(default_factory=dict)


def run_gate(
    project: Path, tree: Path, gate: Gate, group_of: dict[str, str], jobs: int
) -> tuple[RunRecord, list[Mutant]]:
    """mutmut in ``tree`` (a copy of ``project``): the mutants written and classed, the logic ones
    run with the unit tests, the message ones with the golden tests; each mutant with its result.
    Only the groups' files are mutated (a file that pyproject.toml's ``only_mutate`` admits but no
    group names would be run and never scored)."""
    copy_tree(project, tree)
    seconds: dict[str, float] = {}
    started = time.monotonic()
    mutate = [option for source in group_of for option in ("--mutate", source)]
    run_mutmut(tree, [*mutate, "generate", "--max-children", str(jobs)], "generate")
    mutants = read_mutants(tree, group_of, gate.rules)
    # A stale rule or entry fails here, before the run, not after it.
    reviewed, _, _ = reviewed_equivalents(mutants, gate, set(group_of.values()))
    seconds["generate and class"] = time.monotonic() - started
    messages, equivalents = defaultdict(list), defaultdict(list)
    for mutant in mutants:
        if mutant.kind == "message":
            messages[mutant.source].append(mutant.name)
        elif mutant.name in reviewed:
            equivalents[mutant.source].append(mutant.name)
    for source, names in messages.items():
        write_codes(tree, source, dict.fromkeys(names, HELD_BACK))
    for source, names in equivalents.items():
        write_codes(tree, source, dict.fromkeys(names, REVIEWED_EQUIVALENT))
    started = time.monotonic()
    run_mutmut(tree, [*mutate, "run", "--max-children", str(jobs)], "run")
    seconds["logic"] = time.monotonic() - started

    present = [test for test in gate.message_tests if (tree / test.split("::")[0]).exists()]
    if missing := [test for test in gate.message_tests if test not in present] if present else []:
        raise GateError(f"message_tests: {', '.join(missing)} does not exist (the others do)")
    record = RunRecord(present, None if present else "not run: no golden tests", seconds)
    if present and messages:
        started = time.monotonic()
        for source, names in messages.items():
            write_codes(tree, source, dict.fromkeys(names, None))
        # Without the unit tests' stats mutmut maps the golden tests to functions afresh (and keeps
        # the logic results: it reruns only mutants without one).
        (tree / "mutants" / "mutmut-stats.json").unlink()
        tests = [option for test in present for option in ("--tests", test)]
        code, output = mutmut(tree, [*mutate, *tests, "--no-type-check", "run", "--max-children", str(jobs)])
        if code != 0 and NO_TEST_REACHES_A_MUTANT in output:
            for source, names in messages.items():  # the golden tests reach no mutated function
                write_codes(tree, source, dict.fromkeys(names, NO_TESTS))
        elif code != 0:
            raise failure("run (message mutants, golden tests)", code, output)
        seconds["message"] = time.monotonic() - started
    (tree / RUN_RECORD).write_text(json.dumps({"message_tests": record.message_tests, "not_run": record.not_run}) + "\n")
    for source in {mutant.source for mutant in mutants}:
        codes = read_codes(tree, source)
        for mutant in (m for m in mutants if m.source == source):
            mutant.code = codes.get(mutant.name)
    return record, mutants


def read_record(tree: Path) -> RunRecord:
    try:
        data = json.loads((tree / RUN_RECORD).read_text(encoding="utf-8"))
        return RunRecord(list(data["message_tests"]), data["not_run"])
    except (OSError, ValueError, KeyError, TypeError):
        raise GateError(f"{tree}: no {RUN_RECORD}: not a tree this gate ran (run it with --keep)") from None


# ---------------------------------------------------------------------------------------------
# Scoring


@dataclass
class GroupScore:
    name: str
    mutants: int = 0
    logic: int = 0
    equivalent: int = 0
    logic_detected: int = 0
    message: int = 0
    message_detected: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def logic_score(self) -> float:
        counted = self.logic - self.equivalent
        return 100.0 * self.logic_detected / counted if counted else 0.0

    @property
    def message_score(self) -> float | None:
        return 100.0 * self.message_detected / self.message if self.message else None


def reviewed_equivalents(mutants: list[Mutant], gate: Gate, groups: set[str]) -> tuple[set[str], int, int]:
    """The logic mutants a rule or an entry names as equivalent, from their changes alone (no run
    needed); refuses a stale rule or entry (one matching no mutant of its groups, or only message
    mutants, which need none)."""
    scored_modules = {mutant.source.removesuffix(".py").replace("/", ".") for mutant in mutants}
    entries = [e for e in gate.equivalents if e.function.rsplit(".", 1)[0] in scored_modules]
    rules = [rule for rule in gate.rules if set(rule.groups) & groups]
    stale: list[str] = []
    reviewed: set[str] = set()
    for entry in entries:
        matches = [m for m in mutants if m.function == entry.function and (m.removed, m.added) == (entry.removed, entry.added)]
        if not matches or all(m.kind == "message" for m in matches):
            stale.append(f"{entry.function}: {' | '.join(entry.added)}")
        reviewed |= {m.name for m in matches if m.kind == "logic"}
    for rule in rules:
        matches = [m for m in mutants if rule.index in m.rules]
        # A rule names the groups it applies to, and must match a mutant in each one scored.
        stale += [f"{rule.describe()} in {group}" for group in sorted(set(rule.groups) & groups - {m.group for m in matches})]
        reviewed |= {m.name for m in matches}
    if stale:
        raise GateError(
            "equivalent rules or entries that match no logic mutant (the code changed: correct or remove them): "
            + "; ".join(stale)
        )
    return reviewed, len(rules), len(entries)


def score(
    mutants: list[Mutant], gate: Gate, groups: dict[str, list[str]], record: RunRecord, survivors_out: Path | None
) -> tuple[list[GroupScore], int, int]:
    from mutmut.stats import status_by_exit_code

    scores = {group: GroupScore(group) for group in groups}
    if any(m.code is None for m in mutants) or any(m.code == HELD_BACK and m.kind == "logic" for m in mutants):
        raise GateError("mutmut left mutants not checked: its run did not finish")
    reviewed, rules, entries = reviewed_equivalents(mutants, gate, set(groups))
    if unrun := sorted(m.name for m in mutants if m.code == REVIEWED_EQUIVALENT and m.name not in reviewed):
        raise GateError(f"{len(unrun)} mutants were not run as equivalent under another gate file than this one "
                        f"(first: {unrun[0]}): run the gate again")
    # An equivalent mutant a test detects anyway (run before its rule or entry was written) counts as detected.
    excused = {m.name for m in mutants if m.name in reviewed and m.code not in DETECTED_EXIT_CODES}
    survivors = []
    for mutant in mutants:
        group = scores[mutant.group]
        group.mutants += 1
        if mutant.kind == "message":
            group.message += 1
            group.message_detected += mutant.code in DETECTED_EXIT_CODES
            if record.not_run is not None or mutant.code in DETECTED_EXIT_CODES:
                continue
        else:
            group.logic += 1
            if mutant.code in DETECTED_EXIT_CODES:
                group.logic_detected += 1
                group.outcomes[DETECTED_EXIT_CODES[mutant.code]] += 1
                continue
            if mutant.name in excused:
                group.equivalent += 1
                continue
            group.outcomes[status_by_exit_code[mutant.code]] += 1
        status = status_by_exit_code[mutant.code]
        survivors.append(
            {"mutant": mutant.name, "file": mutant.source, "class": mutant.kind, "status": status, "diff": mutant.diff}
        )
    missing = [group.name for group in scores.values() if group.mutants == 0]
    if missing:
        raise GateError(f"groups with no mutants (their files are not mutated): {', '.join(missing)}")
    if survivors_out is not None:
        survivors_out.parent.mkdir(parents=True, exist_ok=True)
        survivors_out.write_text(json.dumps(survivors, indent=1) + "\n", encoding="utf-8")
    return list(scores.values()), rules, entries


def report(scores: list[GroupScore], gate: Gate, record: RunRecord) -> bool:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mutation score per group: logic gated at its floor (target {gate.target:g} %), message text apart")
    columns = (
        "group", "mutants", "logic", "equivalent", "logic detected", "logic %", "floor %",
        "message", "message detected", "message %", "message floor %",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "group" else "right")
    passed = True
    for group in scores:
        message_floor = gate.message_floors.get(group.name)
        if record.not_run is not None:
            message_detected, message_score = "-", record.not_run
        else:
            message_detected = str(group.message_detected)
            message_score = "-" if group.message_score is None else f"{group.message_score:.1f}"
            if message_floor is not None and (group.message_score or 0.0) < message_floor:
                passed = False
        passed &= group.logic_score >= gate.floors[group.name]
        table.add_row(
            group.name, str(group.mutants), str(group.logic), str(group.equivalent), str(group.logic_detected),
            f"{group.logic_score:.1f}", f"{gate.floors[group.name]:g}", str(group.message), message_detected, message_score,
            "not gated" if message_floor is None else f"{message_floor:g}",
        )
    Console(width=160).print(table)
    survived = Counter[str]()
    for group in scores:
        survived.update({status: n for status, n in group.outcomes.items() if status not in DETECTED_EXIT_CODES.values()})
    print("logic mutants not detected: " + (", ".join(f"{n} {status}" for status, n in sorted(survived.items())) or "none"))
    if record.not_run is None:
        print(f"message mutants ran {', '.join(record.message_tests)}")
    short = [group.name for group in scores if group.logic_score < gate.target]
    print(f"target {gate.target:g} %: " + (f"not reached in {', '.join(short)}" if short else "reached in every group"))
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutant workers (default: all cores)")
    parser.add_argument("--survivors", type=Path, help="write every uncaught mutant's diff here (JSON)")
    parser.add_argument("--gate", type=Path, default=GATE, help="the gate file (default: tools/mutation.toml)")
    parser.add_argument("--groups", help="mutate and score only these groups (comma-separated); the gate needs all")
    parser.add_argument("--project", type=Path, default=ROOT, help="the project to mutate (default: this checkout)")
    parser.add_argument("--keep", type=Path, help="run in this new directory and keep it (for --tree)")
    parser.add_argument("--tree", type=Path, help="score a tree an earlier run kept (skips the run)")
    arguments = parser.parse_args(argv)
    try:
        if arguments.jobs < 1:
            raise GateError(f"--jobs: expected 1 or more workers, found {arguments.jobs}")
        if arguments.tree is not None and arguments.keep is not None:
            raise GateError("--tree scores a kept tree and --keep keeps a new run's: give one of them")
        gate = load_gate(arguments.gate)
        groups = gate.groups
        if arguments.groups:
            chosen = arguments.groups.split(",")
            if unknown := sorted(set(chosen) - set(groups)):
                raise GateError(f"--groups: no such group {', '.join(unknown)} (groups: {', '.join(groups)})")
            groups = {name: groups[name] for name in chosen}
        group_of = {source: group for group, files in groups.items() for source in files}
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="mutation-") as scratch:
            if arguments.tree is not None:
                tree = arguments.tree.resolve()
                record = read_record(tree)
                mutants = read_mutants(tree, group_of, gate.rules)
                ran = "scored an existing run"
            else:
                tree = Path(scratch) if arguments.keep is None else arguments.keep.resolve()
                if arguments.keep is not None and arguments.keep.exists() and any(arguments.keep.iterdir()):
                    raise GateError(f"--keep: {arguments.keep} is not empty")
                tree.mkdir(parents=True, exist_ok=True)
                project = arguments.project.resolve()
                record, mutants = run_gate(project, tree, gate, group_of, arguments.jobs)
                steps = ", ".join(f"{step} {spent:.0f} s" for step, spent in record.seconds.items())
                ran = f"mutmut ran in {time.monotonic() - started:.0f} s with {arguments.jobs} workers ({steps})"
            scores, rules, entries = score(mutants, gate, groups, record, arguments.survivors)
    except GateError as error:
        print(f"mutation: {error}", file=sys.stderr)
        return 2
    passed = report(scores, gate, record)
    lowest = min(scores, key=lambda group: group.logic_score)
    excused = sum(g.equivalent for g in scores)
    print(f"{ran}; lowest: {lowest.name}; equivalent mutants excused: {excused} (by {rules} rules and {entries} entries)")
    print(f"mutation_score: {lowest.logic_score:.1f}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
