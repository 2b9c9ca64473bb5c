"""Hostile mutants of one real sealed handoff, as hypothesis strategies, and the oracle that judges them.

A *keyed* mutant is what a hostile producer that holds the run key can send: it changes the
manifest (a field's value or type, its bytes, its serialisation) or the payload and MACs the
result with the run key, so only the checks after the MAC can refuse it. An *unkeyed* mutant is
what anyone else can send: a changed MAC, or a handoff sealed under another key.

:func:`equivalent` is the oracle: an opened mutant is acceptable only when it carries exactly what
the pristine handoff carried, every manifest field but the producer's timings and every tensor
byte. Everything else must be refused with ``HandoffRefused``.

Import as ``from tests.support.wire_mutants import ...``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import safetensors.numpy
from hypothesis import strategies as st

from qualify.contract.lanes import ProducerMode
from qualify.core.digests import canonical_json_bytes
from qualify.core.kv import KVCache, KVGeometry
from qualify.handoff import wire as wire_module
from qualify.handoff.wire import (
    Handoff,
    HandoffExpectation,
    OpenedHandoff,
    SealedHandoff,
    handoff_key_id,
    manifest_canonical_bytes,
    manifest_mac,
    payload_tree_sha256,
    seal_handoff_parts,
)

# A fixed run key, so a failing example reproduces byte for byte.
RUN_KEY = hashlib.sha256(b"wire mutants: the run key").digest()
OTHER_KEY = hashlib.sha256(b"wire mutants: another run's key").digest()
IDENTITY = hashlib.sha256(b"wire mutants: identity").hexdigest()
CACHE_IDENTITY = hashlib.sha256(b"wire mutants: cache identity").hexdigest()
PROMPT = hashlib.sha256(b"wire mutants: prompt").hexdigest()
OTHER_DIGEST = hashlib.sha256(b"wire mutants: some other digest").hexdigest()
RUN_ID = "run-mutants"
REQUEST_ID = "req-1"
LANE = "nvfp4-exact"
MODE = ProducerMode.EXACT
GEOMETRY = KVGeometry(layers=2, kv_heads=2, head_dim=4, positions=8, dtype="float32")
DRAFT_GEOMETRY = KVGeometry(layers=1, kv_heads=1, head_dim=4, positions=8, dtype="float16")


# ------------------------------------------------------------------------------------------
# the pristine handoff


def pristine_kv(draft: bool = False) -> KVCache:
    """The KV every mutant starts from (fixed seed); ``draft`` adds a float16 draft context."""
    rng = np.random.default_rng(20240611)

    def layers(geometry: KVGeometry) -> list[np.ndarray]:
        shape = (geometry.kv_heads, geometry.positions, geometry.head_dim)
        return [rng.standard_normal(shape).astype(geometry.dtype) for _ in range(geometry.layers)]

    kv = KVCache(layers(GEOMETRY), layers(GEOMETRY))
    if draft:
        kv.draft = KVCache(layers(DRAFT_GEOMETRY), layers(DRAFT_GEOMETRY))
    return kv


def seal_pristine(*, draft: bool = False, key: bytes = RUN_KEY, request_id: str = REQUEST_ID,
                  run_id: str = RUN_ID, lane: str = LANE) -> SealedHandoff:
    """The pristine KV sealed as the honest producer of this run would seal it."""
    return seal_handoff_parts(pristine_kv(draft), key=key, identity_sha256=IDENTITY,
                              target_cache_identity=CACHE_IDENTITY, producer_mode=MODE, lane=lane,
                              prompt_sha256=PROMPT, run_id=run_id, request_id=request_id, compute_s=0.25)


def canonical_bytes(document: Any) -> bytes:
    """``document`` as the honest producer writes a manifest (RFC 8785); a value RFC 8785 cannot
    write (an integer past 2**53 - 1) makes it Python's sorted compact form, and a value no JSON
    can hold (an infinite float) Python's ``Infinity`` token: a producer holding the run key may
    send either (the consumer's strict JSON or its schema refuses that value first)."""
    try:
        return manifest_canonical_bytes(document)
    except (ValueError, OverflowError):
        pass
    try:
        return canonical_json_bytes(document)
    except (ValueError, OverflowError):
        return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def _remac(manifest_bytes: bytes, payload: bytes | bytearray | memoryview) -> Handoff:
    """What a producer holding the run key sends: any manifest bytes, MACed with the run key."""
    return Handoff(manifest_bytes, manifest_mac(RUN_KEY, manifest_bytes), payload)


# The producer's measured phase times, fixed so the pristine manifest (and every mutant drawn
# from it) is the same bytes in every run: a failing example reproduces exactly.
PRISTINE_TIMINGS = {"compute_s": 0.25, "serialize_s": 0.0001220703125, "digest_s": 0.000244140625}


@lru_cache(maxsize=4)
def pristine_handoff(draft: bool = False) -> Handoff:
    """The pristine handoff (one contiguous payload), sealed once per variant, with
    :data:`PRISTINE_TIMINGS` in place of the measured ones."""
    sealed = seal_pristine(draft=draft).to_handoff()
    document = json.loads(sealed.manifest_bytes)
    document["timings"] = dict(PRISTINE_TIMINGS)
    return _remac(canonical_bytes(document), sealed.payload_bytes)


def pristine_expectation(draft: bool = False, *, request_id: str = REQUEST_ID) -> HandoffExpectation:
    """What the consumer of this run expects of the pristine handoff."""
    return HandoffExpectation(identity_sha256=IDENTITY, cache_identity=CACHE_IDENTITY, geometry=GEOMETRY,
                              prompt_sha256=PROMPT, run_id=RUN_ID, request_id=request_id, lane=LANE,
                              producer_mode=MODE, draft_geometry=DRAFT_GEOMETRY if draft else None)


@dataclass(frozen=True)
class Mutant:
    """One mutated handoff: how it was made, what it was made from, what it is opened against."""

    kind: str
    what: str
    original: Handoff
    handoff: Handoff
    expectation: HandoffExpectation

    @property
    def key(self) -> bytes:
        """The key the consumer opens it with: always the run key."""
        return RUN_KEY


# ------------------------------------------------------------------------------------------
# the oracle


def _same(found: object, wanted: object) -> bool:
    """Equal values of the same JSON types all the way down (``8.0`` is not ``8``, ``True`` not ``1``)."""
    if type(found) is not type(wanted):
        return False
    if isinstance(wanted, dict):
        assert isinstance(found, dict)
        return found.keys() == wanted.keys() and all(_same(found[k], wanted[k]) for k in wanted)
    if isinstance(wanted, list):
        assert isinstance(found, list)
        return len(found) == len(wanted) and all(_same(a, b) for a, b in zip(found, wanted, strict=True))
    return found == wanted


def _manifest_fields(opened: OpenedHandoff) -> dict[str, Any]:
    """The opened manifest as the JSON fields it came from (all but ``timings`` and the two
    schema constants ``schema``/``payload.format``, which are compared separately)."""
    manifest = opened.manifest
    fields: dict[str, Any] = {
        "run_id": manifest.run_id,
        "request_id": manifest.request_id,
        "lane": manifest.lane,
        "producer_mode": manifest.producer_mode.value,
        "key_id": manifest.key_id,
        "identity_sha256": manifest.identity_sha256,
        "target_cache_identity_sha256": manifest.target_cache_identity_sha256,
        "prompt_sha256": manifest.prompt_sha256,
        "handed_off_positions": manifest.handed_off_positions,
        "geometry": manifest.geometry.as_dict(),
        "payload": {"tree_sha256": manifest.payload_tree_sha256, "bytes": manifest.payload_size},
        "seams": [{"layer": s.layer, "k_sha256": s.k_sha256, "v_sha256": s.v_sha256} for s in manifest.seams],
    }
    if manifest.draft_geometry is not None or manifest.draft_context_sha256 is not None:
        fields["draft_geometry"] = None if manifest.draft_geometry is None else manifest.draft_geometry.as_dict()
        fields["draft_context_sha256"] = manifest.draft_context_sha256
    return fields


def _timings_are_times(opened: OpenedHandoff) -> bool:
    times = (opened.manifest.compute_s, opened.manifest.serialize_s, opened.manifest.digest_s)
    return all(type(t) is float and math.isfinite(t) and t >= 0 for t in times)


def equivalent(original: Handoff, opened: OpenedHandoff) -> bool:
    """True only when ``opened`` carries what ``original`` carried: every manifest field but
    ``timings`` (which must still be finite times >= 0) and every installed tensor's bytes."""
    document = json.loads(bytes(original.manifest_bytes))
    if opened.manifest.schema != document["schema"] or not _timings_are_times(opened):
        return False
    wanted = {k: v for k, v in document.items() if k not in ("schema", "timings")}
    wanted["payload"] = {k: v for k, v in wanted["payload"].items() if k != "format"}
    if not _same(_manifest_fields(opened), wanted):
        return False
    # The original tensors as an independent reader (safetensors itself) loads them.
    tensors = safetensors.numpy.load(bytes(original.payload_bytes))
    installed = opened.kv.tensors()
    if installed.keys() != tensors.keys():
        return False
    return all(
        installed[name].dtype == array.dtype and installed[name].shape == array.shape
        and installed[name].tobytes() == array.tobytes()
        for name, array in tensors.items()
    )


# ------------------------------------------------------------------------------------------
# (a) manifest fields: values, types and serialisations, re-MACed with the run key


@dataclass(frozen=True)
class Raw:
    """A JSON token written verbatim (``1e400``, ``NaN``, ``4.0e0``): what no encoder emits."""

    token: str


_DELETE = object()
_Path = tuple[str | int, ...]

# Tokens a hostile serialiser can write where a number (or anything) goes.
_RAW_TOKENS = ("1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity", "-0", "-0.0", "8.0", "8e0",
               "0.25e0", "1E2", "9" * 25, "1" + "0" * 5000, "[" * 40 + "]" * 40, "[" * 5000 + "]" * 5000,
               "true", "null", '"\\ud800"', '"\\u0000"', '"é"')
_GENERIC_VALUES: tuple[object, ...] = (
    None, True, False, [], {}, "", "x", 0, -1, 1, 2, 7, 8, 9, 1 << 31, (1 << 63) - 1, 1 << 63,
    -(1 << 63) - 1, 1 << 64, 10 ** 30, 0.0, 0.5, 4.0, 8.0, -0.0, 1e300, -1e-300, 5e-324,
)
_VALID_LOOKING: dict[str, tuple[object, ...]] = {
    "schema": ("trust-ladder.handoff-manifest.v3", "trust-ladder.handoff-manifest.v5"),
    "run_id": ("run-2", RUN_ID + "x", RUN_ID.upper()),
    "request_id": ("req-2", "req-0", REQUEST_ID + " "),
    "lane": ("nvfp4-native-w4a4", "other-lane", LANE + "x", "NVFP4-EXACT"),
    "producer_mode": ("native", "exact", "Exact"),
    "key_id": (handoff_key_id(OTHER_KEY), "0" * 16, handoff_key_id(RUN_KEY).upper(), handoff_key_id(RUN_KEY)[:15]),
    "dtype": ("bfloat16", "float16", "float32", "float64", "int8", "F32"),
    "format": ("numpy", "Safetensors"),
}
_TIMINGS = ("compute_s", "serialize_s", "digest_s")


def _paths(value: object, prefix: _Path = ()) -> Iterator[_Path]:
    """Every path in a JSON document, containers and leaves (not the root)."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield (*prefix, key)
        yield from _paths(item, (*prefix, key))


def _get(document: Any, path: _Path) -> Any:
    for part in path:
        document = document[part]
    return document


def _set(document: Any, path: _Path, value: object) -> None:
    """Set (or with ``_DELETE`` remove) the value at ``path``; TypeError when an earlier edit
    changed what holds it (a list where there was an object, say)."""
    parent, last = _get(document, path[:-1]), path[-1]
    if isinstance(parent, dict) and isinstance(last, str):
        if value is _DELETE:
            del parent[last]
        else:
            parent[last] = value
    elif isinstance(parent, list) and isinstance(last, int):
        if value is _DELETE:
            del parent[last]
        else:
            parent[last] = value
    else:
        raise TypeError(f"{list(path)}: an earlier edit changed what holds it")


def _valid_looking(name: str, current: object) -> list[object]:
    """Values of the right type and form that still differ: what reaches the checks past the schema."""
    values: list[object] = list(_VALID_LOOKING.get(name, ()))
    if type(current) is int:
        values += [current + 1, current - 1, current * 2, current + 8]
    elif isinstance(current, str) and len(current) == 64:
        values += [OTHER_DIGEST, IDENTITY, CACHE_IDENTITY, PROMPT]
    elif isinstance(current, str) and current:
        values += [current + "x", current[:-1] or "y"]
    return [value for value in values if not (type(value) is type(current) and value == current)]


def _type_swaps(current: object) -> list[object]:
    """The same value as another JSON type or written another way (``8`` as ``8.0``, ``"8"``, ``[8]``)."""
    swaps: list[object] = [[current], {"value": current}, str(current)]
    try:
        swaps.append(Raw(json.dumps(current, indent=1)))  # the same value, written over several lines
    except TypeError:
        pass  # it holds a Raw token from an earlier edit
    if type(current) is int:
        swaps += [float(current), bool(current), -current, current << 40, Raw(f"{current}.0"),
                  Raw(f"{current}e0"), Raw(f"{current}.000000000000000001")]
    elif type(current) is float:
        # A value an earlier edit left infinite has no int (int() raises): only its other swaps.
        swaps += [int(current)] if math.isfinite(current) else []
        swaps += [current * 1e10, -current - 1.0, Raw(f"{current!r}0"), Raw(f"{current}e0")]
    elif isinstance(current, str):
        swaps += [current.upper(), current[1:] + current[:1], 0,
                  Raw('"' + "".join(f"\\u{ord(c):04x}" for c in current) + '"')]
    return swaps


def _replacements(path: _Path, current: object) -> st.SearchStrategy[object]:
    """Values a hostile producer might put at ``path``: type swaps, out-of-range and overflowing
    numbers, raw tokens, other valid-looking values (weighted up: they reach the run and
    expectation checks), and for timings other finite times (legitimately accepted)."""
    name = next((part for part in reversed(path) if isinstance(part, str)), "")
    options = [st.sampled_from(_type_swaps(current)), st.sampled_from(_GENERIC_VALUES),
               st.sampled_from(_RAW_TOKENS).map(Raw), st.integers(min_value=-(1 << 70), max_value=1 << 70),
               st.text(max_size=6)]
    valid_looking = _valid_looking(name, current)
    if valid_looking:
        options += [st.sampled_from(valid_looking)] * 4
    if name in _TIMINGS:
        options += [st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)] * 2
        options.append(st.floats(allow_nan=False, allow_infinity=False))
    return st.one_of(options)


# How a hostile producer may serialise the manifest it MACs: canonically or not.
SERIALISATIONS = ("canonical", "canonical", "canonical", "indented", "spaced", "reversed-keys", "escaped",
                  "trailing-newline", "leading-space", "bom", "duplicate-key", "ascii")


def _serialise(document: Any, how: str) -> bytes:
    """``document`` as JSON bytes written ``how``; :class:`Raw` values go in verbatim."""
    raws: list[str] = []

    def placeholder(value: object) -> str:
        if isinstance(value, Raw):
            raws.append(value.token)
            return f"@@raw{len(raws) - 1}@@"
        raise TypeError(type(value).__name__)

    def reverse(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: reverse(value[k]) for k in reversed(sorted(value))}
        if isinstance(value, list):
            return [reverse(v) for v in value]
        return value

    compact = {"separators": (",", ":"), "default": placeholder, "allow_nan": True}
    if how == "indented":
        text = json.dumps(document, sort_keys=True, indent=1, ensure_ascii=False, default=placeholder)
    elif how == "spaced":
        text = json.dumps(document, sort_keys=True, ensure_ascii=False, default=placeholder)
    elif how == "reversed-keys":
        text = json.dumps(reverse(document), ensure_ascii=False, **compact)  # type: ignore[arg-type]
    elif how == "ascii":
        text = json.dumps(document, sort_keys=True, ensure_ascii=True, **compact)  # type: ignore[arg-type]
    else:
        text = ""  # canonical (RFC 8785), and the base of the byte edits below
    data = text.encode("utf-8") if text else canonical_bytes(_with_placeholders(document, placeholder))
    for index, token in enumerate(raws):
        data = data.replace(f'"@@raw{index}@@"'.encode(), token.encode())
    if how == "escaped":
        data = data.replace(b'"schema"', b'"\\u0073chema"', 1)
    elif how == "trailing-newline":
        data += b"\n"
    elif how == "leading-space":
        data = b" " + data
    elif how == "bom":
        data = b"\xef\xbb\xbf" + data
    elif how == "duplicate-key":
        data = data[:1] + b'"lane":"other-lane",' + data[1:] if data.startswith(b"{") else data + b"{}"
    return data


def _with_placeholders(value: Any, placeholder: Callable[[object], str]) -> Any:
    """``value`` with every :class:`Raw` token replaced by its placeholder string."""
    if isinstance(value, Raw):
        return placeholder(value)
    if isinstance(value, dict):
        return {key: _with_placeholders(item, placeholder) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_placeholders(item, placeholder) for item in value]
    return value


@st.composite
def _manifest_edit(draw: st.DrawFn, document: dict[str, Any]) -> tuple[str, Callable[[dict[str, Any]], None]]:
    """One edit of a manifest document: replace, delete, add or swap fields."""
    paths = list(_paths(document))
    action = draw(st.sampled_from(("replace", "replace", "replace", "delete", "add", "swap")))
    if action == "replace":
        path = draw(st.sampled_from(paths))
        value = copy.deepcopy(draw(_replacements(path, _get(document, path))))  # never share a cached value
        return f"{list(path)} -> {value!r:.60}", lambda d: _set(d, path, value)
    if action == "delete":
        path = draw(st.sampled_from(paths))
        return f"delete {list(path)}", lambda d: _set(d, path, _DELETE)
    if action == "add":
        containers = [()] + [p for p in paths if isinstance(_get(document, p), dict)]
        where = draw(st.sampled_from(containers))
        name = draw(st.sampled_from(("extra", "draft_geometry", "draft_context_sha256", "layer", "bytes",
                                     "__proto__", "timings", "dtype")))
        value = draw(st.sampled_from((1, "x", None, OTHER_DIGEST, GEOMETRY.as_dict(), DRAFT_GEOMETRY.as_dict())))

        def add(d: dict[str, Any]) -> None:
            _get(d, where)[name] = copy.deepcopy(value)

        return f"add {list(where)}.{name} = {value!r:.40}", add
    first, second = draw(st.lists(st.sampled_from(paths), min_size=2, max_size=2, unique=True).filter(
        lambda pair: pair[0][:len(pair[1])] != pair[1] and pair[1][:len(pair[0])] != pair[0]))  # no nesting

    def swap(d: dict[str, Any]) -> None:
        a, b = _get(d, first), _get(d, second)
        _set(d, first, b)
        _set(d, second, a)

    return f"swap {list(first)} <-> {list(second)}", swap


@st.composite
def manifest_field_mutants(draw: st.DrawFn) -> Mutant:
    """(a) 1-3 field edits (values, types, deletions, additions, swaps) of the pristine manifest,
    serialised canonically or not and re-MACed with the run key."""
    draft = draw(st.booleans())
    original = pristine_handoff(draft)
    document = json.loads(original.manifest_bytes)
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        what, edit = draw(_manifest_edit(document))
        try:
            edit(document)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or retyped the path; the others still apply
        steps.append(what)
    how = draw(st.sampled_from(SERIALISATIONS))
    manifest_bytes = _serialise(document, how)
    return Mutant("manifest-field", f"{'; '.join(steps)} ({how})", original,
                  _remac(manifest_bytes, original.payload_bytes), pristine_expectation(draft))


@st.composite
def manifest_value_mutants(draw: st.DrawFn) -> Mutant:
    """(a) one field set to another value of the right type and form (another lane, key id, run
    id, digest, dimension...), serialised canonically and re-MACed: what only the checks past the
    schema (run binding, geometry, payload, expectation) can refuse."""
    draft = draw(st.booleans())
    original = pristine_handoff(draft)
    document = json.loads(original.manifest_bytes)
    # Every leaf but the timings (other times are legitimately accepted; the field mutants try them).
    leaves = [p for p in _paths(document) if p[0] != "timings" and not isinstance(_get(document, p), (dict, list))]
    path = draw(st.sampled_from(leaves))
    name = next((part for part in reversed(path) if isinstance(part, str)), "")
    value = draw(st.sampled_from(_valid_looking(name, _get(document, path))))
    _set(document, path, value)
    return Mutant("manifest-value", f"{list(path)} -> {value!r:.60}", original,
                  _remac(canonical_bytes(document), original.payload_bytes), pristine_expectation(draft))


# ------------------------------------------------------------------------------------------
# (b) raw manifest bytes, re-MACed


@st.composite
def manifest_byte_mutants(draw: st.DrawFn) -> Mutant:
    """(b) the manifest's bytes flipped, inserted, deleted, truncated or spliced, re-MACed."""
    draft = draw(st.booleans())
    original = pristine_handoff(draft)
    data = bytearray(original.manifest_bytes)
    action = draw(st.sampled_from(("flip", "flip", "set", "insert", "delete", "truncate", "splice")))
    at = draw(st.integers(0, len(data) - 1))
    if action == "flip":
        data[at] ^= draw(st.integers(1, 255))
    elif action == "set":
        data[at] = draw(st.sampled_from(b'0123456789.eE+-"\\{}[],:tfn \x00\x80\xff'))
    elif action == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=4))
    elif action == "delete":
        del data[at : at + draw(st.integers(1, 8))]
    elif action == "truncate":
        del data[at:]
    else:
        length = draw(st.integers(1, 24))
        source = draw(st.integers(0, len(data) - 1))
        data[at:at] = data[source : source + length]
    return Mutant("manifest-bytes", f"{action} at {at}", original, _remac(bytes(data), original.payload_bytes),
                  pristine_expectation(draft))


# ------------------------------------------------------------------------------------------
# (c) payload bytes and payload header, raw or with the manifest resealed around them


def _header_end(payload: bytes) -> int:
    return 8 + int(struct.unpack_from("<Q", payload)[0])


def _tree_of(payload: bytes) -> str | None:
    """The tree digest of a payload whose header places its tensors, or None when it does not."""
    try:
        end = _header_end(payload)
        header = json.loads(payload[8:end])
        spans = sorted((end + e["data_offsets"][0], end + e["data_offsets"][1]) for e in header.values()
                       if isinstance(e, dict) and "data_offsets" in e)
        leaves = [hashlib.sha256(payload[b:e]).digest() for b, e in spans]
        return payload_tree_sha256(payload[:end], leaves)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error, OverflowError):
        return None


def _reseal_payload(original: Handoff, payload: bytes) -> Handoff:
    """A hostile producer's reseal: tree digest and byte count made to match, seams kept."""
    document = json.loads(original.manifest_bytes)
    tree = _tree_of(payload)
    if tree is not None:
        document["payload"]["tree_sha256"] = tree
    document["payload"]["bytes"] = len(payload)
    return _remac(canonical_bytes(document), payload)


def _rebuilt(payload: bytes, edit: Callable[[dict[str, Any]], dict[str, Any]], pad: bytes = b" ") -> bytes:
    """The payload with its header JSON edited (tensor data kept), padded to 8 bytes with ``pad``."""
    end = _header_end(payload)
    header = edit(json.loads(payload[8:end]))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += pad * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + payload[end:]


def _header_edits(header: dict[str, Any], names: list[str]) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    first, second = names[0], names[-1]

    def entry(name: str, **changes: object) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return lambda h: {**h, name: {**h[name], **changes}}

    def float_shape(h: dict[str, Any]) -> dict[str, Any]:
        return {**h, first: {**h[first], "shape": [float(d) for d in h[first]["shape"]]}}

    return {
        "metadata": lambda h: {"__metadata__": {"format": "np"}, **h},
        "reversed-entries": lambda h: dict(reversed(list(h.items()))),
        "dtype-F16": entry(first, dtype="F16"),
        "dtype-BF16": entry(first, dtype="BF16"),
        "dtype-int": entry(first, dtype=7),
        "float-shape": float_shape,
        "shape-swapped": entry(first, shape=list(reversed(header[first]["shape"]))),
        "shape-bool": entry(first, shape=[True, 8, 4]),
        "offsets-float": entry(first, data_offsets=[float(o) for o in header[first]["data_offsets"]]),
        "offsets-negative": entry(first, data_offsets=[-1, header[first]["data_offsets"][1]]),
        "offsets-huge": entry(second, data_offsets=[header[second]["data_offsets"][0], 1 << 64]),
        "offsets-overlap": entry(second, data_offsets=[0, header[second]["data_offsets"][1]]),
        "renamed": lambda h: {(k.replace(".k", ".q") if k == first else k): v for k, v in h.items()},
        "dropped": lambda h: {k: v for k, v in h.items() if k != second},
        "extra-field": entry(first, extra=1),
        "not-object": lambda h: [h],  # type: ignore[dict-item,return-value]
        "swapped-names": lambda h: {**h, first: h[second], second: h[first]},
    }


@st.composite
def payload_mutants(draw: st.DrawFn) -> Mutant:
    """(c) payload bytes flipped, truncated or extended, and payload headers rewritten; sent with
    the original manifest (a change in transit) or resealed by a hostile producer (tree digest and
    byte count recomputed, seams kept)."""
    draft = draw(st.booleans())
    original = pristine_handoff(draft)
    payload = bytes(original.payload_bytes)
    end = _header_end(payload)
    action = draw(st.sampled_from(("flip-data", "flip-data", "flip-header", "flip-length", "truncate", "extend",
                                   "header", "header", "padding", "header-length")))
    if action == "flip-data":
        at = draw(st.integers(end, len(payload) - 1))
        changed = bytearray(payload)
        changed[at] ^= draw(st.integers(1, 255))
        mutated, what = bytes(changed), f"flip data byte {at}"
    elif action == "flip-header":
        at = draw(st.integers(8, end - 1))
        changed = bytearray(payload)
        changed[at] ^= draw(st.integers(1, 255))
        mutated, what = bytes(changed), f"flip header byte {at}"
    elif action == "flip-length":
        at = draw(st.integers(0, 7))
        changed = bytearray(payload)
        changed[at] ^= draw(st.integers(1, 255))
        mutated, what = bytes(changed), f"flip length byte {at}"
    elif action == "truncate":
        cut = draw(st.integers(0, len(payload) - 1))
        mutated, what = payload[:cut], f"truncate to {cut}"
    elif action == "extend":
        extra = draw(st.binary(min_size=1, max_size=16))
        mutated, what = payload + extra, f"extend by {len(extra)}"
    elif action == "header-length":
        length = draw(st.sampled_from((0, 1, end - 9, end - 7, len(payload), 1 << 63, (1 << 64) - 1)))
        mutated, what = struct.pack("<Q", length) + payload[8:], f"header length {length}"
    elif action == "padding":
        mutated, what = _rebuilt(payload, lambda h: h, pad=b"\x00"), "header padded with NUL"
    else:
        header = json.loads(payload[8:end])
        names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
        edits = _header_edits(header, names)
        name = draw(st.sampled_from(sorted(edits)))
        mutated, what = _rebuilt(payload, edits[name]), f"header {name}"
    if draw(st.booleans()):
        return Mutant("payload", f"{what} (resealed)", original, _reseal_payload(original, mutated),
                      pristine_expectation(draft))
    return Mutant("payload", what, original, Handoff(original.manifest_bytes, original.mac, mutated),
                  pristine_expectation(draft))


# ------------------------------------------------------------------------------------------
# (d) unkeyed: the MAC, or another key


@st.composite
def unkeyed_mutants(draw: st.DrawFn) -> Mutant:
    """(d) what a sender without the run key can do: change MAC bytes, change the manifest
    without re-MACing it, or seal under another key."""
    draft = draw(st.booleans())
    original = pristine_handoff(draft)
    action = draw(st.sampled_from(("flip-mac", "short-mac", "long-mac", "empty-mac", "manifest-unmaced",
                                   "other-key", "other-key-claiming-run-key")))
    mac, manifest = bytearray(original.mac), original.manifest_bytes
    if action == "flip-mac":
        mac[draw(st.integers(0, len(mac) - 1))] ^= draw(st.integers(1, 255))
    elif action == "short-mac":
        del mac[draw(st.integers(0, len(mac) - 1)):]
    elif action == "long-mac":
        mac += draw(st.binary(min_size=1, max_size=8))
    elif action == "empty-mac":
        mac = bytearray()
    elif action == "manifest-unmaced":
        changed = bytearray(manifest)
        changed[draw(st.integers(0, len(changed) - 1))] ^= draw(st.integers(1, 255))
        manifest = bytes(changed)
    else:
        sealed = seal_pristine(draft=draft, key=OTHER_KEY).to_handoff()
        manifest, mac = sealed.manifest_bytes, bytearray(sealed.mac)
        if action == "other-key-claiming-run-key":  # names the run key, MACed under another
            document = json.loads(manifest)
            document["key_id"] = handoff_key_id(RUN_KEY)
            manifest = canonical_bytes(document)
            mac = bytearray(manifest_mac(OTHER_KEY, manifest))
    return Mutant("unkeyed", action, original, Handoff(manifest, bytes(mac), original.payload_bytes),
                  pristine_expectation(draft))


def keyed_mutants() -> st.SearchStrategy[Mutant]:
    """Every mutant a hostile producer holding the run key can send ((a), (b), (c))."""
    return st.one_of(manifest_field_mutants(), manifest_value_mutants(), manifest_byte_mutants(), payload_mutants())


def all_mutants() -> st.SearchStrategy[Mutant]:
    """Keyed and unkeyed mutants, manifest field and value mutants weighted up (they reach the
    most checks)."""
    return st.one_of(manifest_field_mutants(), manifest_value_mutants(), manifest_field_mutants(),
                     manifest_value_mutants(), manifest_byte_mutants(), payload_mutants(), unkeyed_mutants())


__all__ = [
    "CACHE_IDENTITY", "DRAFT_GEOMETRY", "GEOMETRY", "IDENTITY", "LANE", "MODE", "OTHER_KEY", "PRISTINE_TIMINGS", "PROMPT",
    "REQUEST_ID", "RUN_ID", "RUN_KEY", "SERIALISATIONS", "Mutant", "Raw", "all_mutants", "equivalent",
    "keyed_mutants", "manifest_byte_mutants", "manifest_field_mutants", "manifest_value_mutants", "payload_mutants",
    "pristine_expectation", "pristine_handoff", "pristine_kv", "seal_pristine", "unkeyed_mutants",
]


# --------------------------------------------------------------------------- inputs that fail inside a stage


def failing_expectation(expectation: HandoffExpectation, field: str, error: BaseException) -> HandoffExpectation:
    """``expectation`` (the consumer's own input to ``open_handoff``) whose ``field`` (an attribute
    or property) raises ``error`` once it has been built: the first stage that reads the field meets
    a failure it does not expect, as it would meet a fault in the consumer's own code."""

    class FailingExpectation(HandoffExpectation):
        armed = False

        def __getattribute__(self, name: str) -> Any:
            if name == field and object.__getattribute__(self, "armed"):
                raise error
            return super().__getattribute__(name)

    failing = FailingExpectation(**{name: getattr(expectation, name) for name in expectation.__dataclass_fields__})
    object.__setattr__(failing, "armed", True)
    return failing


def forbid_hashing(monkeypatch: Any, payload: object) -> None:
    """Any SHA-256 over ``payload``'s bytes fails the test (the MAC and the key id hash other
    bytes): a check that must come before the payload is hashed."""
    real_sha256 = hashlib.sha256

    def sha256(data: Any = b"", *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, memoryview) and data.obj is payload:
            raise AssertionError("the payload was hashed before the check that should have refused it")
        return real_sha256(data, *args, **kwargs)

    monkeypatch.setattr(wire_module, "hashlib", type("NoPayloadHashing", (), {"sha256": staticmethod(sha256)}))
