"""Strict JSON for contract files: small, UTF-8, standard JSON only, checked against a schema.

Every contract document (an onboarding identity, a lane registry) is read here before anything
interprets it, so a file that could mean two things to two readers never reaches a model: a regular
file of at most 1 MiB, strict UTF-8 without BOM, no NaN or Infinity, no duplicate keys, nesting at
most 32 deep, no control characters or lone surrogates in strings. Every refusal is one line
starting ``<label> <path>:``.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError as SchemaError
from jsonschema.exceptions import best_match

from qualify.core.errors import Refused, one_line

MAX_DOCUMENT_BYTES = 1 << 20
"""Largest contract file read (1 MiB); an identity is a few kilobytes."""

MAX_NESTING_DEPTH = 32
"""Deepest array/object nesting accepted; an identity is 4 levels deep."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRUCTURE_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class _NonStandardConstant:
    """Stands in for NaN/Infinity while parsing so the walk can name the field that held it."""

    def __init__(self, text: str) -> None:
        self.text = text


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKey(key)
        document[key] = value
    return document


def format_path(parts: Sequence[str | int]) -> str:
    """A JSON path as ``a.b["x/y"][0]``; the empty path is ``(document)``."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text or "(document)"


def render(value: object, limit: int = 96) -> str:
    """A short one-line JSON rendering of a value for refusal messages."""
    if isinstance(value, _NonStandardConstant):
        return value.text
    try:
        text = json.dumps(value, ensure_ascii=True, sort_keys=False, allow_nan=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    text = one_line(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_nesting(text: str, where: str, max_depth: int = MAX_NESTING_DEPTH) -> None:
    depth = 0
    for match in _STRUCTURE_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > max_depth:
                raise Refused(
                    f"{where}: nesting deeper than {max_depth} levels at character "
                    f"{match.start()}; expected a flat JSON document"
                )
        elif token in "]}":
            depth -= 1


def check_json_values(document: object, where: str) -> None:
    """Refuse NaN/Infinity, overflowing numbers, control characters and lone surrogates anywhere in
    a parsed document (also one built in memory), naming the path that held it."""
    stack: list[tuple[tuple[str | int, ...], object]] = [((), document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _NonStandardConstant):
            raise Refused(
                f"{where}: {format_path(path)}: found {value.text}, expected a finite number "
                f"(NaN and Infinity are not JSON)"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise Refused(
                f"{where}: {format_path(path)}: found a number that overflows to infinity, "
                f"expected a finite number"
            )
        if isinstance(value, str):
            _check_text(value, where, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where, path + (key,), is_key=True)
                stack.append((path + (key,), item))
        elif isinstance(value, list):
            stack.extend((path + (index,), item) for index, item in enumerate(value))


def _check_text(text: str, where: str, path: tuple[str | int, ...], is_key: bool = False) -> None:
    what = "key" if is_key else "string"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(
            f"{where}: {format_path(path)}: {what} holds a lone UTF-16 surrogate, expected text"
        ) from None
    control = _CONTROL.search(text)
    if control is not None:
        raise Refused(
            f"{where}: {format_path(path)}: {what} holds control character "
            f"U+{ord(control.group()):04X}, expected printable text"
        )


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
"""Never follow a link planted where a file was expected; never block opening a FIFO put there."""


def open_regular_file(path: str | os.PathLike[str], where: str) -> tuple[int, int]:
    """A read-only descriptor of a regular file and its size (for callers that stream it), or
    :class:`Refused` naming why."""
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise Refused(f"{where}: no such file") from None
    except OSError as exc:
        raise Refused(f"{where}: cannot open ({exc.strerror or type(exc).__name__}), "
                      f"expected a regular file") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        kind = "is a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise Refused(f"{where}: {kind}, expected a regular file")
    return descriptor, info.st_size


def read_bounded(path: str | os.PathLike[str], limit: int, where: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, or :class:`Refused` (one line
    starting ``where:``); links are not followed, the size is checked before reading and the
    read is capped."""
    descriptor, size = open_regular_file(path, where)
    with os.fdopen(descriptor, "rb") as handle:
        if size > limit:
            raise Refused(f"{where}: {size} bytes, expected at most {limit}")
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise Refused(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > limit:
        raise Refused(f"{where}: grew past {limit} bytes while reading")
    return data


def read_strict_json(path: str | os.PathLike[str], label: str) -> Any:
    """Parse a small JSON file strictly, refusing anything odd with one line naming the file.

    ``label`` starts every refusal (``identity <path>: ...``, ``registry <path>: ...``).
    """
    where = f"{label} {os.fspath(path)}"
    return parse_untrusted_json(read_bounded(path, MAX_DOCUMENT_BYTES, where), where, max_bytes=MAX_DOCUMENT_BYTES)


def parse_untrusted_json(data: bytes | bytearray | memoryview, where: str, *, max_bytes: int,
                         max_depth: int = MAX_NESTING_DEPTH) -> Any:
    """Parse JSON bytes from anywhere untrusted (a file, a producer, a receipt) or raise
    :class:`Refused` with one line starting ``where:``.

    Size and nesting are bounded before the parser runs (so no ``RecursionError`` or
    ``MemoryError`` can escape); then strict UTF-8 without BOM, no duplicate keys, no NaN or
    Infinity, no number overflowing to infinity, no control characters or lone surrogates.
    """
    if len(data) > max_bytes:
        raise Refused(f"{where}: {len(data)} bytes, expected at most {max_bytes}")
    raw = bytes(data)
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise Refused(
            f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            f"expected a UTF-8 JSON document"
        ) from None
    if text.startswith("\ufeff"):
        raise Refused(f"{where}: starts with a byte-order mark; expected UTF-8 JSON without BOM")
    _check_nesting(text, where, max_depth)
    try:
        document = json.loads(
            text, object_pairs_hook=_refuse_duplicates, parse_constant=_NonStandardConstant
        )
    except _DuplicateKey as exc:
        raise Refused(f"{where}: duplicate key {exc.key!r}; each key may appear once") from None
    except json.JSONDecodeError as exc:
        raise Refused(
            f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise Refused(f"{where}: nesting too deep; expected a flat JSON document") from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise Refused(f"{where}: not JSON ({one_line(str(exc))[:120]})") from None
    check_json_values(document, where)
    return document


# --- JSON Schema ------------------------------------------------------------------------------


INT64_RANGE = range(-(1 << 63), 1 << 63)
"""The integers a document may hold: what every reader (numpy, C, another language) can hold."""


def _is_strict_integer(checker: object, instance: object) -> bool:
    # JSON Schema's "integer" admits 4.0 and true would pass as a Python int; neither is one here.
    return type(instance) is int and instance in INT64_RANGE


def _is_strict_number(checker: object, instance: object) -> bool:
    return (type(instance) is int and instance in INT64_RANGE) or (
        type(instance) is float and math.isfinite(instance))


StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_strict_integer, "number": _is_strict_number}),
)
"""Draft 2020-12 with strict JSON types: an ``integer`` is a JSON integer literal within int64
(never ``4.0`` or ``true``), a ``number`` is finite and not a boolean."""


DRAFT_2020_12: str = jsonschema.Draft202012Validator.META_SCHEMA["$id"]
"""The ``$schema`` every contract schema declares: the only draft these validators speak."""


@lru_cache(maxsize=64)  # more than the contracts folder ships
def schema_validator(schema_path: Path) -> jsonschema.Draft202012Validator:
    """The strict draft 2020-12 validator for a shipped contract schema file (read once, cached).

    A file that is not a JSON object declaring draft 2020-12 is refused. The schema is not checked
    against the draft's meta-schema here: that costs about 0.17 s per schema in every process (the
    meta-schema's dynamic references), and every shipped schema passes it in the unit tests
    (tests/unit/core/test_strict_json.py), which is where an edit to one is caught."""
    try:
        schema = json.loads(Path(schema_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Refused(f"contract schema {schema_path}: unusable ({type(exc).__name__})") from None
    if not isinstance(schema, dict) or schema.get("$schema") != DRAFT_2020_12:
        raise Refused(f"contract schema {schema_path}: unusable (expected a JSON object with $schema {DRAFT_2020_12})")
    validator: jsonschema.Draft202012Validator = StrictValidator(schema)
    return validator


def _discriminated_branch(error: SchemaError) -> SchemaError | str | None:
    """For a ``oneOf`` with a ``discriminator`` (how pydantic writes a tagged union): the error of
    the branch the instance's tag picks, or a description of a missing or unknown tag."""
    discriminator = error.schema.get("discriminator") if isinstance(error.schema, dict) else None
    if error.validator != "oneOf" or not isinstance(discriminator, dict):
        return None
    tag_name = discriminator.get("propertyName")
    mapping = discriminator.get("mapping", {})
    instance = error.instance
    path = list(error.absolute_path)
    if not isinstance(instance, dict) or not isinstance(tag_name, str):
        return None
    if tag_name not in instance:
        return f"{format_path(path + [tag_name])}: missing, expected this field"
    tag = instance[tag_name]
    if not isinstance(tag, str) or tag not in mapping:
        choices = ", ".join(render(choice) for choice in mapping)
        return f"{format_path(path + [tag_name])}: found {render(tag)}, expected one of {choices}"
    branch = mapping[tag]
    for index, candidate in enumerate(error.schema.get("oneOf", [])):
        if isinstance(candidate, dict) and candidate.get("$ref") == branch:
            picked = [sub for sub in error.context or [] if sub.schema_path and sub.schema_path[0] == index]
            return best_match(picked) if picked else None
    return None


def describe_schema_error(error: SchemaError) -> str:
    """One line naming the JSON path, what was found and what the schema expects."""
    path = list(error.absolute_path)
    keyword = error.validator
    instance = error.instance
    expected = error.schema.get("description") if isinstance(error.schema, dict) else None
    if keyword == "required" and isinstance(instance, dict):
        missing = [key for key in error.validator_value if key not in instance]
        return f"{format_path(path + missing[:1])}: missing, expected this field"
    if keyword == "additionalProperties" and isinstance(instance, dict):
        known = error.schema.get("properties", {})
        extra = [key for key in instance if key not in known]
        if extra:
            return (
                f"{format_path(path + extra[:1])}: found unexpected field, expected only "
                f"{', '.join(known) or 'declared fields'}"
            )
    if keyword == "propertyNames":
        return f"{format_path(path)}: key {render(instance)}: expected {expected or 'a valid key'}"
    if keyword == "type":
        return f"{format_path(path)}: found {render(instance)}, expected type {error.validator_value}"
    if keyword == "const":
        return f"{format_path(path)}: found {render(instance)}, expected {render(error.validator_value)}"
    if keyword == "enum":
        choices = ", ".join(render(choice) for choice in error.validator_value)
        return f"{format_path(path)}: found {render(instance)}, expected one of {choices}"
    if keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        relation = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
        return (
            f"{format_path(path)}: found {render(instance)}, expected a number "
            f"{relation[keyword]} {error.validator_value}"
        )
    if keyword == "not" and expected:
        return f"{format_path(path)}: found the placeholder {render(instance)}, expected {expected}"
    if expected and keyword in ("pattern", "minLength", "maxLength", "not"):
        return f"{format_path(path)}: found {render(instance)}, expected {expected}"
    return f"{format_path(path)}: {one_line(error.message)[:200]}"


def check_schema(document: object, schema_path: Path, where: str) -> None:
    """Refuse a document that breaks its contract schema, reporting the best-matching error (for a
    tagged union, the error of the branch its tag picks)."""
    errors: list[SchemaError] = []
    for error in schema_validator(schema_path).iter_errors(document):
        branch = _discriminated_branch(error)
        if isinstance(branch, str):
            raise Refused(f"{where}: {branch}")
        errors.append(error if branch is None else branch)
    best = best_match(errors)
    if best is not None:
        raise Refused(f"{where}: {describe_schema_error(best)}")


__all__ = [
    "INT64_RANGE",
    "MAX_DOCUMENT_BYTES",
    "MAX_NESTING_DEPTH",
    "StrictValidator",
    "check_json_values",
    "check_schema",
    "describe_schema_error",
    "format_path",
    "parse_untrusted_json",
    "read_strict_json",
    "render",
    "schema_validator",
]
