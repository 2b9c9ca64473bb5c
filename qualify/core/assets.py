"""Where the shipped contracts, model, tokenizer, prompts and basis receipts live, and the prompt digest rule.

Every asset is named by its path relative to the *asset root* (``model/nvfp4/model.safetensors``,
``contracts/trust.v1.schema.json``, ``receipts/<run-id>/manifest.json``), the same names identities
pin. The root is found once, here, through ``importlib.resources``: an installed wheel carries the
checkout's top-level ``contracts/``, ``model/`` and ``receipts/`` as the package data of
``qualify._shipped`` (pyproject.toml maps them), and a checkout (``pip install -e .`` or
``PYTHONPATH``) uses its own top level. A missing asset is a broken install, refused in one line
(:func:`require_asset`), never read as a tampered receipt or an uncaught fault.

A prompt's canonical byte form is its token ids as little-endian uint32, concatenated;
``prompt_sha256`` is the SHA-256 of those bytes.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path, PurePosixPath

import numpy as np

from qualify.core import model_choice
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused

ASSET_DIRS = ("contracts", "model", "receipts")
"""The top-level folders of a checkout that a wheel ships as ``qualify/_shipped/<name>``."""
SHIPPED_PACKAGE = "qualify._shipped"

PACKAGE_PARENT = Path(__file__).resolve().parents[2]
"""The folder holding the ``qualify`` package: a checkout's top level, or site-packages. Adapter
sources (``qualify/engines/kquant.py``) resolve against it, so an identity's pins name the same file
in a checkout and in a wheel."""
REPO_ROOT = PACKAGE_PARENT
"""The checkout's top level (only meaningful in a checkout: tests and checkout-only tools use it;
the harness itself resolves assets through :data:`ASSET_ROOT`)."""


class AssetMissing(Refused):
    """A file the harness ships is not where the install put it: the harness cannot run (exit 2)."""


def _holds_assets(root: Path) -> bool:
    return all((root / name).is_dir() for name in ASSET_DIRS)


def _find_asset_root() -> tuple[Path, str]:
    """The asset root and what it is ("installed" or "checkout"): the wheel's package data first,
    then the checkout the package was imported from. When neither holds the assets, the wheel's
    place, so :func:`require_asset` names it in its refusal."""
    installed = PACKAGE_PARENT / "qualify" / "_shipped"
    try:
        shipped = importlib.resources.files(SHIPPED_PACKAGE)
    except ModuleNotFoundError:  # an install from before the package existed: its assets are missing
        shipped = None
    # A wheel installed on disk gives a real folder; a zipped install is not supported (the
    # engines map checkpoint files), so it reads as assets missing.
    if isinstance(shipped, Path):
        installed = shipped
    if _holds_assets(installed):
        return installed, "installed"
    if _holds_assets(PACKAGE_PARENT) and (PACKAGE_PARENT / "pyproject.toml").is_file():
        return PACKAGE_PARENT, "checkout"
    return installed, "installed"


ASSET_ROOT, ASSET_SOURCE = _find_asset_root()
"""The folder that holds ``contracts/``, ``model/`` and ``receipts/``, and where it came from."""
MODEL_DIR = ASSET_ROOT / "model"
PROMPTS_DIR = MODEL_DIR / "prompts"
CONTRACTS_DIR = ASSET_ROOT / "contracts"
RECEIPTS_DIR = ASSET_ROOT / "receipts"
"""The shipped basis receipts that identities cite (``receipt://<run-id>/<file>``)."""


def _checked_relpath(relpath: str) -> PurePosixPath:
    """``relpath`` as a path, refused unless it is plain: relative, no empty, ``.`` or ``..`` part."""
    if any(part in ("", ".", "..") for part in relpath.split("/")):
        raise Refused(f"asset {relpath!r}: not a plain relative path under the asset root")
    return PurePosixPath(relpath)


def asset_path(relpath: str) -> Path:
    """The path of the asset named ``relpath`` (``model/config.json``), whether or not it exists."""
    return ASSET_ROOT.joinpath(*_checked_relpath(relpath).parts)


def asset_relpath(path: Path) -> str:
    """The asset name of a path under the asset root (what identities and receipts record)."""
    try:
        return path.relative_to(ASSET_ROOT).as_posix()
    except ValueError:
        raise Refused(f"asset {path}: not under the asset root {ASSET_ROOT}") from None


def missing_asset(relpath: str) -> AssetMissing:
    """The one-line refusal for a shipped file that is not there (the file's name comes first)."""
    # The advice comes before the folder: a caller may cut a long line, never the file's name.
    if ASSET_SOURCE == "checkout":
        fix = f"restore it in the checkout (git status shows it): {ASSET_ROOT}"
    else:
        fix = f"the install is incomplete: reinstall trust-ladder (assets at {ASSET_ROOT})"
    return AssetMissing(f"asset {relpath}: missing; the harness cannot run without it; {fix}")


def require_asset(relpath: str) -> Path:
    """The path of the shipped file ``relpath``, refused (:class:`AssetMissing`) when it is not a
    file: a missing asset means the harness cannot run, whatever command hit it."""
    path = asset_path(relpath)
    if not path.is_file():
        raise missing_asset(relpath)
    return path


def require_source_file(relpath: str) -> Path:
    """A harness source file by its package-relative name (``qualify/engines/kquant.py``), as
    installed (identities pin adapter sources by these names); refused like :func:`require_asset`."""
    path = PACKAGE_PARENT.joinpath(*_checked_relpath(relpath).parts)
    if not path.is_file():
        raise AssetMissing(f"harness source {relpath}: missing under {PACKAGE_PARENT}; the install is incomplete: "
                           f"reinstall trust-ladder")
    return path


MAIN_PROMPT = "python-textwrap"
PROMPT_NAMES = ("python-textwrap", "prose-email-architecture", "config-idle-keys")


def prompt_bytes(tokens: np.ndarray) -> bytes:
    """The canonical byte form: token ids as little-endian uint32."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def prompt_sha256(tokens: np.ndarray) -> str:
    return sha256_bytes(prompt_bytes(tokens))


def load_prompt(name: str = MAIN_PROMPT) -> np.ndarray:
    """Token ids (int64 [2048]) of a held-out document, refusing unknown names: the committed ids
    of the shipped model, or under a chosen ``--model`` its rule applied under that model's
    tokenizer (:func:`chosen_model_tokens`)."""
    if name not in PROMPT_NAMES:
        raise Refused(f"prompt: unknown name {name!r}; expected one of {', '.join(PROMPT_NAMES)}")
    path = require_asset(f"model/prompts/{name}.json")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        committed = np.asarray(document["token_ids"], dtype=np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise Refused(f"{path}: cannot read prompt token ids ({type(exc).__name__})") from None
    return chosen_model_tokens(name, committed)


def chosen_model_tokens(name: str, committed: np.ndarray) -> np.ndarray:
    """``committed`` (a record's shipped-tokenizer ids) for the shipped model; under a chosen
    ``--model``, the record's rule (the first as many tokens of its source text) under that
    model's tokenizer."""
    choice = model_choice.chosen()
    if choice is None:
        return committed
    return choice.rule_tokens(name, len(committed), source_text(name))


SOURCES_DIR = "model/sources"
"""The held-out CPython 3.11.7 source texts the prompts and documents are cut from, as shipped
copies (``<name>.txt``), so the same rule ("the first N tokens of this text under a model's
tokenizer") gives the same prompt for any model on any Python, not only on this stdlib."""


def source_text(name: str) -> str:
    """The source text of prompt or document ``name``, checked against the ``source_sha256`` its
    ``model/prompts`` or ``model/documents`` record states; a differing copy is refused."""
    records = [relpath for relpath in (f"model/prompts/{name}.json", f"model/documents/{name}.json")
               if asset_path(relpath).is_file()]
    if not records:
        raise Refused(f"source text: unknown name {name!r}; no model/prompts or model/documents record")
    data = require_asset(f"{SOURCES_DIR}/{name}.txt").read_bytes()
    for relpath in records:
        expected = json.loads(asset_path(relpath).read_text(encoding="utf-8")).get("source_sha256")
        if sha256_bytes(data) != expected:
            raise Refused(f"{SOURCES_DIR}/{name}.txt: sha256 {sha256_bytes(data)}, expected {expected} ({relpath})")
    return data.decode("utf-8")
