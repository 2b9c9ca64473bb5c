#!/usr/bin/env python3
"""Build the calibration and control documents from held-out CPython 3.11.7 stdlib files.

Each document is fixed by rule here, before any lane is measured: the first N tokens of one
stdlib file under the shipped tokenizer (``model/tokenizer.json``, never retrained here). None of
these files is in the training corpus (``model/corpus-manifest.json``: only non-test ``.py`` files
were trained on), none is the qualification fixture (``python-textwrap``), and the calibration
set shares no file with the controls:

* calibration set (bounds are measured here, at prompt lengths 1024 and 1792):
  ``python-test-heapq``, ``prose-idle-history``, ``grammar-lib2to3``;
* E2 controls (judged against E1 gates at nested lengths 512..4096): ``python-test-shlex``,
  ``prose-idle-news``, ``config-idle-keys``.

Writes ``model/documents/<name>.json`` (token ids plus the rule and source digest).

Usage: python tools/build_documents.py [--stdlib DIR] [--check]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_TOKENS = 1792
CONTROL_TOKENS = 4096
DOCUMENTS: dict[str, tuple[str, str, str, int]] = {
    # name: (stdlib-relative source, kind, set, tokens kept)
    "python-test-heapq": ("test/test_heapq.py", "python source (tests, held out of training)", "calibration",
                          CALIBRATION_TOKENS),
    "prose-idle-history": ("idlelib/HISTORY.txt", "prose history", "calibration", CALIBRATION_TOKENS),
    "grammar-lib2to3": ("lib2to3/Grammar.txt", "grammar definition", "calibration", CALIBRATION_TOKENS),
    "python-test-shlex": ("test/test_shlex.py", "python source (tests, held out of training)", "control",
                          CONTROL_TOKENS),
    "prose-idle-news": ("idlelib/NEWS2x.txt", "prose changelog", "control", CONTROL_TOKENS),
    "config-idle-keys": ("idlelib/config-keys.def", "INI configuration", "control", CONTROL_TOKENS),
}
FIXTURE_SOURCE = "textwrap.py"


def token_sha256(token_ids: list[int]) -> str:
    """SHA-256 of token ids as little-endian uint32 (``qualify.core.assets.prompt_bytes``)."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


def document_record(prog: str, tokenizer: Tokenizer, stdlib: Path, name: str, relpath: str, kind: str, role: str,
                    keep: int, extra: dict[str, object] | None = None) -> dict[str, object]:
    """One document: the first ``keep`` tokens of ``Lib/<relpath>`` under ``tokenizer``, with its rule
    and digests (``extra`` goes after the source digest); exits naming the file when it is shorter."""
    source = stdlib / relpath
    token_ids = tokenizer.encode(source.read_text(encoding="utf-8")).ids
    if len(token_ids) < keep:
        raise SystemExit(f"{prog}: {relpath} has {len(token_ids)} tokens, need {keep}")
    kept = token_ids[:keep]
    return {
        "name": name,
        "kind": kind,
        "set": role,
        "source": f"CPython 3.11.7 Lib/{relpath}",
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        **(extra or {}),
        "rule": f"the first {keep} tokens of Lib/{relpath} under the shipped tokenizer",
        "tokens": keep,
        "token_sha256": token_sha256(kept),
        "token_ids": kept,
    }


def build(stdlib: Path) -> dict[str, dict[str, object]]:
    tokenizer = Tokenizer.from_file(str(ROOT / "model" / "tokenizer.json"))
    trained = {entry["path"] for entry in json.loads((ROOT / "model" / "corpus-manifest.json").read_text())["files"]}
    documents: dict[str, dict[str, object]] = {}
    for name, (relpath, kind, role, keep) in DOCUMENTS.items():
        if relpath in trained or relpath == FIXTURE_SOURCE:
            raise SystemExit(f"build_documents: {relpath} is in the training corpus or is the fixture")
        documents[name] = document_record("build_documents", tokenizer, stdlib, name, relpath, kind, role, keep)
    return documents


def write_documents(prog: str, documents: dict[str, dict[str, object]], out: Path, check: bool) -> int:
    """Write each document to ``out/<name>.json`` (or, with ``check``, compare it with the committed
    file and write nothing): 0 done or the same, 1 some differ (named on stderr)."""
    out.mkdir(parents=True, exist_ok=True)
    differing = []
    for name, document in documents.items():
        text = json.dumps(document) + "\n"
        path = out / f"{name}.json"
        if check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                differing.append(name)
            continue
        path.write_text(text, encoding="utf-8")
        print(f"{name}: {document['tokens']} tokens, token_sha256 {document['token_sha256']}")
    if differing:
        print(f"{prog}: differs from the committed files: {', '.join(differing)}", file=sys.stderr)
        return 1
    return 0


def stdlib_arguments(doc: str | None, prog: str) -> argparse.Namespace | None:
    """``--stdlib`` and ``--check``; None (after one line on stderr) when this is not CPython 3.11.7,
    whose stdlib every rule names."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = parser.parse_args()
    if sys.version_info[:3] != (3, 11, 7):
        print(f"{prog}: expected CPython 3.11.7's stdlib", file=sys.stderr)
        return None
    return args


def main() -> int:
    args = stdlib_arguments(__doc__, "build_documents")
    if args is None:
        return 2
    return write_documents("build_documents", build(args.stdlib), ROOT / "model" / "documents", args.check)


if __name__ == "__main__":
    raise SystemExit(main())
