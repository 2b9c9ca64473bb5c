"""Build the training corpus, the BPE tokenizer and the held-out prompts from CPython's stdlib.

Text anyone has: the ``.py`` sources of the CPython 3.11.7 standard library (tests excluded).
The held-out documents are fixed by rule here, before any lane is measured:

* ``python-textwrap`` (the main qualification prompt): the first 2048 tokens of ``textwrap.py``,
  which is excluded from the training corpus;
* ``prose-email-architecture``: the first 2048 tokens of ``email/architecture.rst`` (prose);
* ``config-idle-keys``: the first 2048 tokens of ``idlelib/config-keys.def`` (INI config).

Only ``.py`` files are trained on, so the two non-Python documents are held out by construction.
Writes ``model/tokenizer.json``, ``model/corpus-manifest.json`` (file list with SHA-256),
``model/prompts/*.json`` (token ids) and ``.cache/corpus.u16`` (token ids for training).

Usage: python tools/build_corpus.py [--stdlib DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 4096
END_OF_TEXT = "<|endoftext|>"
PROMPT_TOKENS = 2048
EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
HELD_OUT = {
    "python-textwrap": ("textwrap.py", "python source"),
    "prose-email-architecture": ("email/architecture.rst", "prose documentation"),
    "config-idle-keys": ("idlelib/config-keys.def", "INI configuration"),
}
MAIN_PROMPT = "python-textwrap"


def corpus_files(stdlib: Path) -> list[Path]:
    held_out = {stdlib / rel for rel, _ in HELD_OUT.values()}
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel_parts = path.relative_to(stdlib).parts
        if EXCLUDED_PARTS.intersection(rel_parts) or path in held_out:
            continue
        files.append(path)
    return files


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = parser.parse_args()
    stdlib: Path = args.stdlib
    version = ".".join(map(str, sys.version_info[:3]))
    if version != "3.11.7":
        print(f"build_corpus: expected CPython 3.11.7's stdlib, running {version}", file=sys.stderr)
        return 2

    files = corpus_files(stdlib)
    texts = [p.read_text(encoding="utf-8", errors="strict") for p in files]
    tokenizer = train_tokenizer(texts)
    (ROOT / "model").mkdir(exist_ok=True)
    tokenizer.save(str(ROOT / "model" / "tokenizer.json"))
    eot = tokenizer.token_to_id(END_OF_TEXT)

    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    (ROOT / ".cache").mkdir(exist_ok=True)
    np.asarray(ids, dtype=np.uint16).tofile(ROOT / ".cache" / "corpus.u16")

    manifest = {
        "source": f"CPython {version} standard library, *.py, tests excluded",
        "files": [
            {"path": str(p.relative_to(stdlib)), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in files
        ],
        "file_count": len(files),
        "bytes": sum(len(t.encode()) for t in texts),
        "tokens": len(ids),
        "held_out": {name: rel for name, (rel, _) in HELD_OUT.items()},
    }
    (ROOT / "model" / "corpus-manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    prompts = ROOT / "model" / "prompts"
    prompts.mkdir(exist_ok=True)
    for name, (rel, kind) in HELD_OUT.items():
        source = stdlib / rel
        token_ids = tokenizer.encode(source.read_text(encoding="utf-8")).ids
        if len(token_ids) < PROMPT_TOKENS:
            print(f"build_corpus: {rel} has {len(token_ids)} tokens, need {PROMPT_TOKENS}", file=sys.stderr)
            return 2
        document = {
            "name": name,
            "kind": kind,
            "source": f"CPython {version} Lib/{rel}",
            "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
            "rule": f"the first {PROMPT_TOKENS} tokens of Lib/{rel} under the shipped tokenizer",
            "main": name == MAIN_PROMPT,
            "token_ids": token_ids[:PROMPT_TOKENS],
        }
        (prompts / f"{name}.json").write_text(json.dumps(document) + "\n")
    print(f"corpus: {len(files)} files, {manifest['bytes']} bytes, {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
