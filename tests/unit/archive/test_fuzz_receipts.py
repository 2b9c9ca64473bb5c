"""Fuzzing ``receipts verify`` with mutants of one real signed receipt: byte edits and JSON field
edits of the manifest, edits and replacements of every listed file, and consistent forgeries (a
hostile document with the manifest rehashed, in its RFC 8785 form, to match). No mutant passes the
manifest's own checks (``verify_receipt``), none is verified by the signed statement either, none
raises, none hangs; those also run through the real CLI exit 1, print every problem as a TAMPERED
line and list a healthy neighbour as verified. (Mutants of the envelope and statement, and re-signed
ones: tests/unit/archive/test_fuzz_signed_receipts.py.)

Default tier: a few hundred mutants; ``slow`` tier: ten times as many (over 2,000)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from qualify.archive.keys import load_signing_key
from qualify.archive.layout import MANIFEST
from qualify.archive.verify import RECEIPT_JSON_MAX_BYTES, authenticate_receipt, verify_receipt
from qualify.core.digests import jcs_bytes
from qualify.interfaces.cli import main
from tests.support.receipt_forgery import make_writable, operator_trust, write_receipt

FAST = 1
SLOW = 10
"""Tier multipliers of each test's example count (defaults sum to 230; slow to 2,300)."""

BOUND_S = 60.0
"""Generous bound on one verification: a blocked open of a FIFO would never end."""

LISTED = ("command.log", "host.json", "identity.json", "identity.sha256", "samples/sample-1.json",
          "samples/sample-2.json", "samples/sample-3.json", "validation-summary.json", "versions.json")
JSON_LISTED = tuple(name for name in LISTED if name.endswith(".json"))

RAW_TOKENS = (
    "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "4.0", "4e0", "-0", "true", '"4"',
    "[" * 33 + "]" * 33, "[" * 5000 + "]" * 5000, '{"a":' * 40 + "0" + "}" * 40,
    '"\\ud800"', '"\\u0000"', '"a\\nb"', "9" * 5000, "18446744073709551616",
)
"""JSON texts that a strict reader must refuse or a strict schema must reject where an integer,
a hex digest or a path belongs."""

PAYLOADS = st.one_of(  # half the time a token that stresses a JSON reader (depth, size, encoding)
    st.binary(min_size=1, max_size=8),
    st.sampled_from([b"[", b"{", b"]", b"}", b'"', b",", b":", b"\\", b"\xff", b"\xc0\x80", b"\xef\xbb\xbf",
                     b"\x00", b"\n", b" ", b"1e400", b"NaN", b"true", b"null", b"4.0", b"[" * 5000,
                     b'{"a":' * 100, b'"\\ud800"', b"9" * 5000]),
)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)

VARIANTS = ("as_float", "as_true", "as_false", "as_null", "as_string", "as_number", "int64_overflow",
            "negative", "empty_list", "empty_object", "wrapped", "shortened", "upper", "raw", "generic")


# --------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Mutation:
    """One edit of a receipt directory; its repr is what a failing example prints."""

    description: str
    apply: Callable[[Path], None]

    def __repr__(self) -> str:
        return self.description


@dataclass(frozen=True)
class ByteEdit:
    """A byte-level edit of a file's content."""

    kind: str
    position: int
    length: int
    mask: int
    payload: bytes

    def apply(self, data: bytes) -> bytes:
        if not data:
            return self.payload
        at = self.position % len(data)
        end = min(len(data), at + self.length)
        if self.kind == "flip":
            return data[:at] + bytes([data[at] ^ self.mask]) + data[at + 1:]
        if self.kind == "truncate":
            return data[:at]
        if self.kind == "insert":
            return data[:at] + self.payload + data[at:]
        if self.kind == "delete":
            return data[:at] + data[end:]
        if self.kind == "duplicate":
            return data[:end] + data[at:end] + data[end:]
        return data[:at] + self.payload + data[at + len(self.payload):]  # overwrite


BYTE_EDITS = st.builds(
    ByteEdit, kind=st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate", "overwrite"]),
    position=st.integers(0, 1 << 20), length=st.integers(1, 64), mask=st.integers(1, 255), payload=PAYLOADS,
)


def _paths(document: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every JSON path in a document, the root first."""
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found.extend(_paths(value, (*prefix, index)))
    return found


def _derive(old: Any, variant: str, raw: str, generic: Any) -> Any:
    """A replacement for ``old``: a type change (4 -> 4.0/true/"4"), a near miss, or raw text
    (returned as :class:`RawJson`, spliced in when rendering)."""
    is_int = type(old) is int
    table: dict[str, Any] = {
        "as_float": float(old) if is_int else 4.0,
        "as_true": True,
        "as_false": False,
        "as_null": None,
        "as_string": str(old) if not isinstance(old, str) else old + " ",
        "as_number": old + 1 if is_int else 4,
        "int64_overflow": RawJson(str(1 << 63)),
        "negative": -1,
        "empty_list": [],
        "empty_object": {},
        "wrapped": [old],
        "shortened": old[:-1] if isinstance(old, str) else "",
        "upper": old.upper() if isinstance(old, str) else "X",
        "raw": RawJson(raw),
    }
    return table.get(variant, generic)


@dataclass(frozen=True)
class RawJson:
    """JSON text to splice into a rendered document as is (1e400, deep nesting, a lone surrogate)."""

    text: str


def _holds(parent: Any, key: str | int) -> bool:
    """Whether ``parent[key]`` exists (an object member or a list index)."""
    if isinstance(parent, dict):
        return key in parent
    return isinstance(parent, list) and isinstance(key, int) and 0 <= key < len(parent)


def _canonical_text(document: Any) -> str:
    """The manifest's one byte form (RFC 8785), or for a document RFC 8785 refuses (an integer
    beyond 2**53) the same compact sorted form the parser then refuses it in."""
    try:
        return jcs_bytes(document).decode("utf-8", errors="surrogatepass")
    except ValueError:
        return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _render(document: Any, style: int = 0, *, jcs: bool = False) -> bytes:
    """Render with :class:`RawJson` values spliced in; style 0 is the receipt's canonical form
    (RFC 8785 for the manifest, ``jcs``; sorted 2-space JSON for the other files), others are the
    same document written otherwise (compact, unsorted, escaped)."""
    raws: dict[str, str] = {}

    def placeholders(value: Any) -> Any:
        if isinstance(value, RawJson):
            raws[f"@@RAW{len(raws)}@@"] = value.text
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {key: placeholders(item) for key, item in value.items()}
        if isinstance(value, list):
            return [placeholders(item) for item in value]
        return value

    prepared = placeholders(document)
    options: list[dict[str, Any]] = [
        {"indent": 2, "sort_keys": True, "ensure_ascii": False},
        {"separators": (",", ":"), "sort_keys": True, "ensure_ascii": False},
        {"indent": 2, "sort_keys": False, "ensure_ascii": False},
        {"indent": 4, "sort_keys": True, "ensure_ascii": True},
    ]
    if jcs and style == 0:
        text = _canonical_text(prepared)
    else:
        text = json.dumps(prepared, allow_nan=True, **options[style % len(options)]) + "\n"
    for marker, raw in raws.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode("utf-8", errors="surrogatepass")


@dataclass(frozen=True)
class FieldEdit:
    """A JSON-level edit of one field (picked by ``target`` among the document's paths)."""

    op: str
    target: int
    variant: str
    raw: str
    generic: Any
    style: int

    def apply(self, document: Any, allowed: tuple[tuple[str | int, ...], ...] | None = None,
              *, jcs: bool = False) -> bytes:
        paths = list(allowed) if allowed else _paths(document)
        path = paths[self.target % len(paths)]

        def render(edited: Any) -> bytes:
            return _render(edited, jcs=jcs)

        if self.op == "render":
            return _render(document, 1 + self.style)
        if not path:  # the root itself
            return render(_derive(document, self.variant, self.raw, self.generic))
        parent = document
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if not _holds(parent, last):
            return render(document)  # an allowed path this document lacks: unchanged
        if self.op == "replace":
            parent[last] = _derive(parent[last], self.variant, self.raw, self.generic)
        elif self.op == "delete":
            del parent[last]
        elif self.op == "add":
            if isinstance(parent, dict):
                parent[f"{last}_extra"] = self.generic
            else:
                parent.append(self.generic)
        elif self.op == "duplicate":
            if isinstance(parent, dict):  # the same key twice in the rendered text
                parent["@@DUPLICATE@@"] = parent[last]
                return render(document).replace(b'"@@DUPLICATE@@"', json.dumps(last).encode(), 1)
            parent.append(parent[last])
        elif self.op == "rename":
            if isinstance(parent, dict):
                parent[f"{last}_"] = parent.pop(last)
            else:
                parent.append(parent.pop(last))
        return render(document)


FIELD_EDITS = st.builds(
    FieldEdit, op=st.sampled_from(["replace", "replace", "replace", "delete", "add", "duplicate", "rename", "render"]),
    target=st.integers(0, 1 << 16), variant=st.sampled_from(VARIANTS) | st.just("raw"), raw=st.sampled_from(RAW_TOKENS),
    generic=JSON_VALUES, style=st.integers(0, 2),
)


def rewrite(path: Path, data: bytes) -> None:
    """Replace an existing file's content in place. Not ``write_bytes``: truncating a file to
    zero makes ext4 flush it on close (auto_da_alloc), milliseconds per example."""
    with open(path, "r+b") as handle:
        handle.write(data)
        handle.truncate()


def _edit_bytes(name: str, edit: ByteEdit) -> Mutation:
    def apply(receipt: Path) -> None:
        path = receipt / name
        rewrite(path, edit.apply(path.read_bytes()))
    return Mutation(f"{name}: {edit}", apply)


def _edit_field(name: str, edit: FieldEdit,
                allowed: tuple[tuple[str | int, ...], ...] | None = None) -> Mutation:
    def apply(receipt: Path) -> None:
        path = receipt / name
        rewrite(path, edit.apply(json.loads(path.read_bytes()), allowed, jcs=name == MANIFEST))
    return Mutation(f"{name}: {edit}", apply)


def _rehashed(mutation: Mutation) -> Mutation:
    """The mutation, then the manifest rewritten (RFC 8785) so every digest and size match: a
    consistent forgery only the cross-checks between files and the signed statement can catch."""
    def apply(receipt: Path) -> None:
        mutation.apply(receipt)
        manifest = json.loads((receipt / MANIFEST).read_bytes())
        for entry in manifest["files"]:
            with open(receipt / entry["path"], "rb") as handle:
                entry["sha256"] = hashlib.file_digest(handle, "sha256").hexdigest()
            entry["bytes"] = (receipt / entry["path"]).stat().st_size
        rewrite(receipt / MANIFEST, jcs_bytes(manifest))
    return Mutation(f"rehashed {mutation.description}", apply)


def _structural(name: str, kind: str) -> Mutation:
    """Replace or add a file by something other than an edited regular file."""
    def apply(receipt: Path) -> None:
        path = receipt / name
        if kind == "remove":
            path.unlink()
        elif kind == "directory":
            path.unlink()
            path.mkdir()
        elif kind == "symlink_inside":
            path.unlink()
            path.symlink_to(receipt / ("versions.json" if name != "versions.json" else "command.log"))
        elif kind == "symlink_to_identical_copy":
            copy = receipt.parent.parent / f"copy-of-{path.name}"  # outside the archive
            shutil.copyfile(path, copy)
            path.unlink()
            path.symlink_to(copy)
        elif kind == "fifo":
            path.unlink()
            os.mkfifo(path)
        elif kind == "empty":
            path.write_bytes(b"")
        elif kind == "sparse_huge":
            with open(path, "r+b") as handle:
                handle.truncate(RECEIPT_JSON_MAX_BYTES + (1 << 30))
        elif kind == "extra_sibling":
            (path.parent / f"{path.name}.bak").write_bytes(path.read_bytes())
        elif kind == "extra_directory":
            (path.parent / "extra").mkdir()
        elif kind == "hidden_sibling":
            (path.parent / f".{path.name}").write_bytes(b"{}")
        elif kind == "renamed":
            path.rename(path.parent / f"0{path.name}")
    return Mutation(f"{name}: {kind}", apply)


STRUCTURAL_KINDS = ("remove", "directory", "symlink_inside", "symlink_to_identical_copy", "fifo", "empty",
                    "sparse_huge", "extra_sibling", "extra_directory", "hidden_sibling", "renamed")


def _samples_directory(kind: str) -> Mutation:
    def apply(receipt: Path) -> None:
        samples = receipt / "samples"
        if kind == "symlink":
            moved = receipt.parent.parent / "moved-samples"  # outside the archive
            samples.rename(moved)
            samples.symlink_to(moved, target_is_directory=True)
        elif kind == "file":
            shutil.rmtree(samples)
            samples.write_bytes(b"[]")
        elif kind == "removed":
            shutil.rmtree(samples)
        elif kind == "nested":
            (samples / "sample-4.json").mkdir()
            (samples / "sample-4.json" / "sample-1.json").write_bytes(b"{}")
    return Mutation(f"samples/: {kind}", apply)


manifest_byte_mutations = BYTE_EDITS.map(lambda edit: _edit_bytes(MANIFEST, edit))
manifest_field_mutations = FIELD_EDITS.map(lambda edit: _edit_field(MANIFEST, edit))
listed_file_mutations = st.one_of(
    st.builds(_edit_bytes, st.sampled_from(LISTED), BYTE_EDITS),
    st.builds(_edit_field, st.sampled_from(JSON_LISTED), FIELD_EDITS),
    st.builds(_structural, st.sampled_from(LISTED), st.sampled_from(STRUCTURAL_KINDS)),
    st.builds(_samples_directory, st.sampled_from(["symlink", "file", "removed", "nested"])),
)

_SUMMARY_CHECKED = (("run_id",), ("identity_sha256",), ("passed",), ("samples",))
_HOST_CHECKED: tuple[tuple[str | int, ...], ...] = (("schema",), ("consumer",), ("producers",))


@st.composite
def forgeries(draw: st.DrawFn) -> Mutation:
    """A hostile edit the manifest is then rehashed to cover: each one breaks a cross-check
    (identity digest, summary fields, host.json structure) or the strict reader itself."""
    target = draw(st.sampled_from(["identity.json", "validation-summary.json", "host.json", "identity.sha256",
                                   "raw"]))
    if target == "identity.sha256":
        flip = draw(st.builds(ByteEdit, kind=st.just("flip"), position=st.integers(0, 63), length=st.just(1),
                              mask=st.integers(1, 255), payload=st.just(b"")))
        return _rehashed(_edit_bytes(target, flip))
    if target == "raw":  # breaks the strict reader whatever the content
        name = draw(st.sampled_from(["identity.json", "validation-summary.json", "host.json"]))
        kind = draw(st.sampled_from(["bom", "not_utf8", "truncated", "sparse_huge"]))
        position = draw(st.integers(0, 1 << 20))
        return _rehashed(Mutation(f"{name}: {kind} at {position}", _breaking_edit(name, kind, position)))
    edit = draw(FIELD_EDITS.filter(lambda e: e.op != "render"))
    allowed = {"validation-summary.json": _SUMMARY_CHECKED, "host.json": _HOST_CHECKED}.get(target)
    if allowed is not None:
        assume(_breaks_a_cross_check(edit, allowed[edit.target % len(allowed)]))
    return _rehashed(_edit_field(target, edit, allowed))


def _breaks_a_cross_check(edit: FieldEdit, path: tuple[str | int, ...]) -> bool:
    """Whether an edit of a checked summary or host.json field must fail the cross-checks: an
    unchecked extra summary field, one boolean for another, or an object of consumer facts and a
    list of producer starts in their place would be legitimate."""
    generic_container = edit.variant == "generic" and isinstance(edit.generic, dict | list)
    if edit.op == "add":
        return path in _HOST_CHECKED  # an extra top-level key of host.json
    if edit.op != "replace":
        return True
    if path == ("passed",):
        return edit.variant not in ("as_true", "as_false") and not (edit.variant == "raw" and edit.raw == "true") \
            and not (edit.variant == "generic" and isinstance(edit.generic, bool))
    if path in (("consumer",), ("producers",)):
        return edit.variant not in ("empty_object", "empty_list", "wrapped") and not generic_container
    return True


def _breaking_edit(name: str, kind: str, position: int) -> Callable[[Path], None]:
    def apply(receipt: Path) -> None:
        path = receipt / name
        data = path.read_bytes()
        if kind == "bom":
            data = b"\xef\xbb\xbf" + data
        elif kind == "not_utf8":
            at = position % len(data)
            data = data[:at] + b"\xff" + data[at:]
        elif kind == "truncated":  # the closing brace goes: never a whole JSON object
            data = data[:position % (len(data) - 1)]
        rewrite(path, data)
        if kind == "sparse_huge":
            with open(path, "r+b") as handle:
                handle.truncate(RECEIPT_JSON_MAX_BYTES + 1)
    return apply


# --------------------------------------------------------------------------- the property


def _state(root: Path) -> dict[str, tuple[object, ...]]:
    """What a receipt directory holds, from metadata alone: per relative path its kind, and a
    file's size and modification time (copies keep it) or a link's target."""
    found: dict[str, tuple[object, ...]] = {}
    for current, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(current) / name
            info = path.lstat()
            key = path.relative_to(root).as_posix()
            if stat.S_ISREG(info.st_mode):
                found[key] = ("file", info.st_size, info.st_mtime_ns)
            elif stat.S_ISLNK(info.st_mode):
                found[key] = ("link", os.readlink(path))
            else:
                found[key] = ("other", stat.S_IFMT(info.st_mode))
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _restore_tree(source: Path, target: Path) -> None:
    """Make ``target`` hold what ``source`` holds, touching only what differs (files are copied
    with their modification time, so an untouched file is known by its metadata)."""
    if target.is_symlink() or not target.is_dir():
        if os.path.lexists(target):
            _remove(target)
        shutil.copytree(source, target, symlinks=True)
        return
    wanted = {entry.name: entry for entry in os.scandir(source)}
    for entry in os.scandir(target):
        if entry.name not in wanted:
            _remove(Path(entry.path))
    for name, entry in wanted.items():
        here = target / name
        if entry.is_dir(follow_symlinks=False):
            _restore_tree(Path(entry.path), here)
            continue
        was = entry.stat()
        if here.is_symlink() or not here.is_file():
            if os.path.lexists(here):
                _remove(here)
            shutil.copy2(entry.path, here)
            continue
        now = here.stat()
        if (now.st_size, now.st_mtime_ns) != (was.st_size, was.st_mtime_ns):
            rewrite(here, Path(entry.path).read_bytes())
            os.utime(here, ns=(was.st_atime_ns, was.st_mtime_ns))


@dataclass(frozen=True)
class Workspace:
    """One scratch archive every example reuses: a receipt to mutate and a healthy neighbour, put
    back to the pristine state after each mutant (making, removing and even opening files costs
    a fraction of a millisecond on some disks; a fresh copy per example would dominate the run)."""

    pristine: Path
    scratch: Path
    receipt: Path
    neighbour: Path
    state: dict[str, tuple[object, ...]]
    contents: dict[str, bytes]
    trust: Any
    neighbour_line: str

    def restore(self) -> None:
        """Undo whatever the last mutant did, in the receipt and beside it."""
        for entry in os.scandir(self.scratch):
            if entry.name != self.receipt.parent.name:
                _remove(Path(entry.path))
        for entry in os.scandir(self.receipt.parent):
            if entry.name not in (self.receipt.name, self.neighbour.name):
                _remove(Path(entry.path))
        _restore_tree(self.pristine, self.receipt)
        assert _state(self.receipt) == self.state, "the workspace was not restored"

    def unchanged(self) -> bool:
        """Whether the receipt holds exactly the pristine bytes (a rewrite with the same bytes
        is no mutant)."""
        state = _state(self.receipt)
        if state.keys() != self.state.keys():
            return False
        for key, now in state.items():
            was = self.state[key]
            if now == was:
                continue
            if now[0] != "file" or was[0] != "file" or now[1] != was[1]:
                return False
            if (self.receipt / key).read_bytes() != self.contents[key]:
                return False
        return True


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    pristine = tmp_path_factory.mktemp("pristine")
    receipt, neighbour = write_receipt(pristine), write_receipt(pristine)
    make_writable(receipt)
    make_writable(neighbour)  # copies keep the modes: writable mutants, removable scratch
    assert verify_receipt(receipt) == [] and verify_receipt(neighbour) == []
    trust = operator_trust()
    assert authenticate_receipt(receipt, trust).state == "verified" == authenticate_receipt(neighbour, trust).state
    scratch = tmp_path_factory.mktemp("scratch")
    shutil.copytree(pristine, scratch / "archive", symlinks=True)
    state = _state(receipt)
    contents = {key: (receipt / key).read_bytes() for key, kind in state.items() if kind[0] == "file"}
    neighbour_line = (f"ok        {neighbour.name}: passed; signed by {load_signing_key().key_id[:16]}…, "
                      "10 files match the signed statement")
    return Workspace(receipt, scratch, scratch / "archive" / receipt.name, scratch / "archive" / neighbour.name,
                     state, contents, trust, neighbour_line)


def _within_bound(action: Callable[[], Any]) -> Any:
    """Run ``action`` on a thread and return its result (or raise its exception); fails when it
    does not end within :data:`BOUND_S`."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, action()))
        except BaseException as exc:  # handed back to the test thread
            outcome.append((False, exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(BOUND_S)
    if not outcome:
        raise AssertionError(f"verification did not end within {BOUND_S} s (a hang)")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _run_cli(target: Path) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["receipts", "verify", str(target)])
    return code, out.getvalue().splitlines(), err.getvalue()


def check_mutant(workspace: Workspace, tally: Any, mutation: Mutation, via: str) -> None:
    """Apply ``mutation`` to the pristine receipt; it must fail verification with one-line
    problems naming it, raise nothing, end in bounded time, and (``via`` the CLI, alone or in an
    archive beside a healthy neighbour) exit 1 listing every receipt."""
    workspace.restore()
    receipt = workspace.receipt
    mutation.apply(receipt)
    if workspace.unchanged():
        tally.add("identical_skipped")
        assume(False)
    tally.add("examples")
    try:
        problems = _within_bound(lambda: verify_receipt(receipt))
    except AssertionError:
        tally.add("hangs")
        raise
    except BaseException:
        tally.add("raw_exceptions")
        raise
    checked = _within_bound(lambda: authenticate_receipt(receipt, workspace.trust))
    if not problems or checked.state == "verified":
        tally.add("accepted")
    assert problems, f"{mutation!r} verified intact"
    assert checked.state == "tampered", (mutation, checked)
    tally.add("refused")
    for problem in problems:
        assert "\n" not in problem and problem.startswith(f"{receipt.name}: "), problem
        assert problem.removeprefix(f"{receipt.name}: ") in checked.problems, (problem, checked)
    if any(": cannot check" in problem for problem in problems + checked.problems):
        tally.add("cannot_check")  # a caught surprise: still a bug, every problem has a name
    assert not any(": cannot check" in problem for problem in problems + checked.problems), checked
    if via == "direct":
        return
    code, out, err = _within_bound(lambda: _run_cli(receipt.parent if via == "archive" else receipt))
    tally.add(f"cli_{via}")
    tally.add(f"cli_exit_{code}")
    assert code == 1 and err == "", (code, out, err)
    assert [line for line in out if line.startswith("TAMPERED ")] == \
        [f"TAMPERED  {receipt.name}: {p}" for p in checked.problems]
    if via == "archive":
        assert workspace.neighbour_line in out, out
        assert out[-1] == "2 receipts: 1 verified (1 passed), 1 tampered", out
    else:
        assert out[-1] == "1 receipts: 0 verified, 1 tampered", out


VIA = st.sampled_from(["direct", "direct", "single", "archive"])
"""Half the mutants also go through the real CLI in-process: alone, or in an archive."""


def fuzz(workspace: Workspace, tally: Any, mutations: st.SearchStrategy[Mutation], examples: int,
         explicit: tuple[Mutation, ...] = ()) -> None:
    """Run the ``explicit`` mutants, then ``examples`` generated ones (identical ones are skipped,
    not counted), through check_mutant."""

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    @given(mutation=mutations, via=VIA)
    def run(mutation: Mutation, via: str) -> None:
        check_mutant(workspace, tally, mutation, via)

    for index, mutation in enumerate(explicit):
        run = example(mutation=mutation, via=("direct", "single", "archive")[index % 3])(run)
    run()


def _replace(name: str, target: int, variant: str, raw: str = "",
             allowed: tuple[tuple[str | int, ...], ...] | None = None) -> Mutation:
    """An explicit field replacement (``target`` indexes ``allowed``, else the document's paths,
    root first)."""
    return _edit_field(name, FieldEdit("replace", target, variant, raw, None, 0), allowed)


MANIFEST_FIRST_SIZE = 3
"""Path index of ``files[0].bytes`` in a manifest: (document), files, files[0], files[0].bytes."""

TIERS = [pytest.param(FAST, id="fast"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]


@pytest.mark.parametrize("tier", TIERS)
def test_manifest_byte_mutations_never_verify(workspace, fuzz_tally, tier):
    deep = ByteEdit("insert", 0, 1, 1, b"[" * 5000)
    fuzz(workspace, fuzz_tally, manifest_byte_mutations, 60 * tier, (_edit_bytes(MANIFEST, deep),))


@pytest.mark.parametrize("tier", TIERS)
def test_manifest_field_mutations_never_verify(workspace, fuzz_tally, tier):
    explicit = tuple(_replace(MANIFEST, MANIFEST_FIRST_SIZE, variant, raw) for variant, raw in (
        ("as_float", ""), ("as_true", ""), ("as_string", ""), ("raw", "1e400"), ("raw", "[" * 5000 + "]" * 5000)))
    fuzz(workspace, fuzz_tally, manifest_field_mutations, 70 * tier, explicit)


@pytest.mark.parametrize("tier", TIERS)
def test_listed_file_mutations_never_verify(workspace, fuzz_tally, tier):
    explicit = (_structural("samples/sample-1.json", "fifo"), _structural("host.json", "sparse_huge"),
                _samples_directory("symlink"))
    fuzz(workspace, fuzz_tally, listed_file_mutations, 60 * tier, explicit)


@pytest.mark.parametrize("tier", TIERS)
def test_consistent_forgeries_never_verify(workspace, fuzz_tally, tier):
    count = _SUMMARY_CHECKED.index(("samples",))
    explicit = (_rehashed(_replace("validation-summary.json", count, "as_float", "", _SUMMARY_CHECKED)),
                _rehashed(_replace("validation-summary.json", count, "raw", "true", _SUMMARY_CHECKED)),
                _rehashed(_replace("identity.json", 0, "raw", "[" * 5000 + "]" * 5000)))
    fuzz(workspace, fuzz_tally, forgeries(), 40 * tier, explicit)
