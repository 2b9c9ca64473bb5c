#!/usr/bin/env python3
"""Build the long-context control documents (32768 tokens each) that ``bench/gpu_e2_grid.py`` reads.

The E2 control documents (``model/documents``) stop at 4096 tokens, and their sources are too
short for 32768. These three are fixed by the same kind of rule, before any long cell was
measured: the first 32768 tokens of one held-out CPython 3.11.7 stdlib file under the shipped
tokenizer (``model/tokenizer.json``, 4096 ids, all inside the 8B shape's vocabulary). None is in
the training corpus, the calibration set, the controls or the fixture. The token ids are
committed (``bench/documents/<name>.json``), so the device machine, on another Python, reads the
very same ids; each file states its rule, source digest and token digest.

Usage: python tools/build_long_documents.py [--stdlib DIR] [--check]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from build_documents import DOCUMENTS, FIXTURE_SOURCE, document_record, stdlib_arguments, write_documents

LONG_TOKENS = 32768
LONG_DOCUMENTS: dict[str, tuple[str, str]] = {
    # name: (stdlib-relative source, kind)
    "python-test-descr": ("test/test_descr.py", "python source (tests, held out of training)"),
    "c-test-clinic": ("test/clinic.test.c", "C source (Argument Clinic test input)"),
    "data-decimal-squareroot": ("test/decimaltestdata/squareroot.decTest", "test-case table (decimal arithmetic)"),
}
OUT_DIR = ROOT / "bench" / "documents"


def build(stdlib: Path) -> dict[str, dict[str, object]]:
    tokenizer_path = ROOT / "model" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    trained = {entry["path"] for entry in json.loads((ROOT / "model" / "corpus-manifest.json").read_text())["files"]}
    taken = {relpath for relpath, *_ in DOCUMENTS.values()} | {FIXTURE_SOURCE}
    documents: dict[str, dict[str, object]] = {}
    for name, (relpath, kind) in LONG_DOCUMENTS.items():
        if relpath in trained or relpath in taken:
            raise SystemExit(f"build_long_documents: {relpath} is trained on, the fixture, or another set's document")
        documents[name] = document_record(
            "build_long_documents", tokenizer, stdlib, name, relpath, kind, "long-control", LONG_TOKENS,
            extra={"tokenizer_sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()})
    return documents


def main() -> int:
    args = stdlib_arguments(__doc__, "build_long_documents")
    if args is None:
        return 2
    return write_documents("build_long_documents", build(args.stdlib), OUT_DIR, args.check)


if __name__ == "__main__":
    raise SystemExit(main())
