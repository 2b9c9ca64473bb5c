"""Which model a process qualifies: the shipped one, or the one ``--model`` named.

``--model`` is chosen once per process, before any engine, prompt or contract is loaded (the CLI,
the recipe plugin, the producer service and the freeze tool each do it first), and everything
that depends on the model asks here: the checkpoint files an identity pins, where its contracts
live, and the token ids of every prompt and document. Those are cut by each record's rule ("the
first N tokens of this source text") from the shipped source texts under the chosen model's own
tokenizer, so the same rule gives every model its own prompt, fixed before any measurement.

A chosen model's files are pinned under ``models/<name>/<file>``; ``<name>`` is a published
model's name, else the last component of the path given (a directory's or a GGUF file's name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qualify.core.errors import Refused

MODELS_PREFIX = "models"
"""Checkpoint keys of a chosen model start ``models/<name>/``; the shipped model's start ``model/``."""
MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class ModelChoice:
    """A chosen model as the layers below the engines see it: its name, its files' digests
    (``models/<name>/<file>`` -> SHA-256, with sizes), and its tokenizer."""

    name: str
    argument: str  # as --model gave it (what a producer process is started with)
    path: Path
    files: Mapping[str, str]
    file_sizes: Mapping[str, int]
    tokenizer: Any  # tokenizers.Tokenizer
    tokenizer_sha256: str

    def rule_tokens(self, name: str, count: int, source: str) -> np.ndarray:
        """The first ``count`` token ids (int64) of ``source`` under this model's tokenizer: a
        prompt's or document's rule applied to its source text ``name``; refused when the text
        holds fewer tokens."""
        ids = self.tokenizer.encode(source).ids
        if len(ids) < count:
            raise Refused(f"--model {self.name}: source text {name} holds {len(ids)} tokens under the model's "
                          f"tokenizer, its rule needs {count}")
        return np.asarray(ids[:count], dtype=np.int64)


_CHOSEN: list[ModelChoice] = []


def model_name_for(argument: str, path: Path, published: bool) -> str:
    """The name a chosen model's files are pinned under (see the module docstring); refused when
    the path's last component cannot be one (only letters, digits, ``._-``)."""
    name = argument if published else path.name
    if not MODEL_NAME.fullmatch(name):
        raise Refused(f"--model {argument}: name {name!r} (the path's last component) is not a plain file name; "
                      "expected letters, digits, '.', '_' or '-'")
    return name


def choose(choice: ModelChoice | None) -> None:
    """Make ``choice`` the process's model (None: the shipped model again)."""
    _CHOSEN.clear()
    if choice is not None:
        _CHOSEN.append(choice)


def chosen() -> ModelChoice | None:
    """The model ``--model`` chose for this process, or None for the shipped model."""
    return _CHOSEN[0] if _CHOSEN else None


def pinned_model_name(files: Mapping[str, str], where: str) -> str | None:
    """The chosen model an identity's checkpoint map names (``models/<name>/...`` keys), or None
    when it pins the shipped model; refused when it mixes models or mixes both kinds."""
    names = {key.split("/")[1] if key.startswith(f"{MODELS_PREFIX}/") and key.count("/") >= 2 else None
             for key in files}
    if len(names) != 1:
        shown = ", ".join(sorted(name or "the shipped model" for name in names))
        raise Refused(f"{where}: checkpoint.files: pins files of {shown}, expected one model's files")
    return next(iter(names))


def file_key(name: str, relative: str) -> str:
    return f"{MODELS_PREFIX}/{name}/{relative}"

