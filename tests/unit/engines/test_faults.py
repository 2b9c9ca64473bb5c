"""Producer faults (qualify.engines.faults): names with a magnitude (``NAME=VALUE``) parse to the
fault they say, a bad value is refused in one line naming the fault and the accepted range, and
each corruption touches exactly its site; the bare names keep their bytes. Also the detection-power
bench's search over a fault grid (bench/detection_power.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a shared 2-core machine: keep BLAS to one thread

from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines import faults

THETA = 10000.0
LAYERS, HEADS, POSITIONS, DIMS = 4, 4, 1100, 8  # room for the kv-ulp site (1000) and block swaps up to 358


def random_kv(dtype: Any = np.float32, positions: int = POSITIONS) -> KVCache:
    rng = np.random.default_rng(7)
    shape = (HEADS, positions, DIMS)
    return KVCache([rng.standard_normal(shape).astype(dtype) for _ in range(LAYERS)],
                   [rng.standard_normal(shape).astype(dtype) for _ in range(LAYERS)])


def apply(name: str, kv: KVCache) -> KVCache:
    transform = faults.kv_transform(name, THETA)
    assert transform is not None
    return transform(kv)


def changed(before: KVCache, after: KVCache) -> dict[str, np.ndarray]:
    """Tensor name -> indices (head, position, dim) of every element that differs bit for bit."""
    out = {}
    for name, tensor in before.tensors().items():
        other = after.tensors()[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape
        bits = f"u{tensor.itemsize}"
        differs = np.argwhere(tensor.view(bits) != other.view(bits))
        if differs.size:
            out[name] = differs
    return out


def same_bytes(a: KVCache, b: KVCache) -> bool:
    return all(x.tobytes() == y.tobytes() for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))


# ---- names and values ------------------------------------------------------------------------------


def test_every_bare_name_is_its_own_fault_unchanged() -> None:
    for name, fault in faults.FAULTS.items():
        assert faults.fault_named(name) is fault


@pytest.mark.parametrize(("given", "name", "kind", "value"), [
    ("v-scale=1.001", "v-scale=1.001", "v-scale", 1.001),
    ("v-scale=1.0010", "v-scale=1.001", "v-scale", 1.001),
    ("k-scale=1.5", "k-scale=1.5", "k-scale", 1.5),
    ("kv-ulp=16", "kv-ulp=16", "kv-ulp", 16),
    ("position-shift=3", "position-shift=3", "position-shift", 3.0),
    ("position-shift=2e-3", "position-shift=0.002", "position-shift", 0.002),
    ("block-swap=64", "block-swap=64", "block-swap", 64),
    ("head-swap=0016", "head-swap=16", "head-swap", 16),
    ("element-scale=2e3", "element-scale=2000", "element-scale", 2000.0),
    ("last-position-scale=1.01", "last-position-scale=1.01", "last-position-scale", 1.01),
])
def test_a_value_names_a_fault_of_its_class_written_one_way(given: str, name: str, kind: str, value: float) -> None:
    fault = faults.fault_named(given)
    assert (fault.name, fault.kind, fault.value) == (name, kind, value)
    assert faults.fault_named(fault.name) == fault  # the written name parses back to the same fault
    assert fault.rungs == faults.FAULT_CLASSES[kind].rungs


def test_the_default_value_is_described_as_the_bare_name_is() -> None:
    for bare, written in (("v-scale", "v-scale=1.02"), ("kv-ulp", "kv-ulp=1"), ("rope-offset", "position-shift=1"),
                          ("block-order", "block-swap=128")):
        assert faults.fault_named(written).expect == faults.FAULTS[bare].expect
        assert faults.fault_named(written).kind == faults.FAULTS[bare].kind
        assert faults.fault_named(written).value == faults.FAULTS[bare].value
    assert faults.fault_named("v-scale=1.02").description == faults.FAULTS["v-scale"].description


@pytest.mark.parametrize(("kind", "inside", "outside"), [
    ("v-scale", ["1.0000001", "2"], ["1.00000009", "2.0000001", "1", "0.5"]),
    ("k-scale", ["1.0000001", "2.0"], ["1.00000009", "2.0000001"]),
    ("kv-ulp", ["1", "65536"], ["0", "65537"]),
    ("position-shift", ["0.000001", "1e-6", "4096"], ["0.00000099", "4096.0001", "0"]),
    ("block-swap", ["1", "512"], ["0", "513"]),
    ("head-swap", ["1", "4096"], ["0", "4097"]),
    ("element-scale", ["1.0000001", "1000000"], ["1", "1000000.1"]),
    ("last-position-scale", ["1.0000001", "2"], ["1", "2.0000001"]),
])
def test_values_are_accepted_exactly_up_to_each_end_of_the_range(kind: str, inside: list[str], outside: list[str]) -> None:
    for text in inside:
        assert faults.fault_named(f"{kind}={text}").kind == kind
    for text in outside:
        with pytest.raises(Refused) as refused:
            faults.fault_named(f"{kind}={text}")
        assert str(refused.value) == f"fault {kind}: found {text!r}, expected {faults.FAULT_CLASSES[kind].expected}"


@pytest.mark.parametrize("text", ["", "nan", "inf", "-inf", "1e999", "-1.5", "+1.5", " 1.5", "1.5 ", "1_0", "1.5e",
                                  "0x10", "1,5", "1.5=2", "½"])
def test_a_malformed_value_is_refused_naming_the_fault_and_the_range(text: str) -> None:
    with pytest.raises(Refused, match=r"^fault v-scale: found .*, expected a number from 1\.0000001 to 2 \(F: layer 2 V"):
        faults.fault_named(f"v-scale={text}")


@pytest.mark.parametrize("text", ["16.0", "1e2", "16.5", "-16"])
def test_a_whole_number_class_refuses_anything_but_digits(text: str) -> None:
    with pytest.raises(Refused, match=r"^fault kv-ulp: found .*, expected a whole number from 1 to 65536"):
        faults.fault_named(f"kv-ulp={text}")


@pytest.mark.parametrize(("name", "message"), [
    ("nosuch", "fault: unknown name 'nosuch'; expected one of block-order, kv-ulp, other-mode, other-prompt, rope-offset, "
               "v-scale, or NAME=VALUE with NAME one of block-swap, element-scale, head-swap, k-scale, kv-ulp, last-position-scale, position-shift, v-scale"),
    ("nosuch=1", "fault: unknown name 'nosuch' in 'nosuch=1'; expected one of "),
    ("V-SCALE=1.1", "fault: unknown name 'V-SCALE' in 'V-SCALE=1.1'; "),
    ("=1.1", "fault: unknown name '' in '=1.1'; "),
    ("k-scale", "fault k-scale: needs a value, k-scale=VALUE with VALUE a number from 1.0000001 to 2"),
    ("head-swap", "fault head-swap: needs a value, head-swap=VALUE with VALUE a whole number from 1 to 4096"),
    ("other-prompt=1", "fault other-prompt: takes no value, found 'other-prompt=1'; faults with a value are "),
    ("block-order=64", "fault block-order: takes no value, found 'block-order=64'"),
    ("rope-offset=2", "fault rope-offset: takes no value"),
])
def test_names_that_are_no_fault_are_refused_in_one_line(name: str, message: str) -> None:
    with pytest.raises(Refused) as refused:
        faults.fault_named(name)
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)
    with pytest.raises(Refused):  # the transform and the producer validate through the same function
        faults.kv_transform(name, THETA)


@pytest.mark.parametrize("name", [None, 1.02, b"v-scale", ["v-scale"]])
def test_a_name_that_is_not_text_is_refused(name: object) -> None:
    with pytest.raises(Refused, match="^fault: found .*, expected a fault name$"):
        faults.fault_named(name)  # type: ignore[arg-type]


def test_faults_applied_elsewhere_have_no_kv_transform() -> None:
    assert faults.kv_transform("other-prompt", THETA) is None
    assert faults.kv_transform("other-mode", THETA) is None


# ---- what each corruption does ----------------------------------------------------------------------


def test_the_bare_names_corrupt_what_their_parameterized_forms_do() -> None:
    kv = random_kv()
    for bare, written in (("v-scale", "v-scale=1.02"), ("kv-ulp", "kv-ulp=1"), ("rope-offset", "position-shift=1"),
                          ("block-order", "block-swap=128")):
        assert same_bytes(apply(bare, kv), apply(written, kv))


@pytest.mark.parametrize(("name", "tensor"), [("v-scale", "v"), ("k-scale", "k")])
@pytest.mark.parametrize("factor", ["1.0000001", "1.001", "2"])
def test_a_scale_touches_only_the_named_layer_and_tensor(name: str, tensor: str, factor: str) -> None:
    kv = random_kv()
    faulty = apply(f"{name}={factor}", kv)
    wire_name = f"layers.{faults.FAULT_LAYER}.{tensor}"
    assert list(changed(kv, faulty)) == [wire_name]
    original = kv.tensors()[wire_name]
    # Every element moves, even at the smallest factor: it is never a no-op.
    assert changed(kv, faulty)[wire_name].shape[0] == original.size
    assert np.array_equal(faulty.tensors()[wire_name], original * np.float32(float(factor)))


@pytest.mark.parametrize("count", [1, 2, 16, 1000])
def test_k_nudges_change_exactly_that_many_elements_by_one_ulp(count: int) -> None:
    kv = random_kv()
    faulty = apply(f"kv-ulp={count}", kv)
    differing = changed(kv, faulty)
    wire_name = f"layers.{faults.FAULT_LAYER}.k"
    assert list(differing) == [wire_name] and differing[wire_name].shape[0] == count
    before, after = kv.keys[faults.FAULT_LAYER], faulty.keys[faults.FAULT_LAYER]
    moved = tuple(differing[wire_name].T)
    assert np.array_equal(after[moved], np.nextafter(before[moved], np.float32(np.inf)))
    assert [faults.FAULT_HEAD, faults.FAULT_POSITION, faults.FAULT_DIM] in differing[wire_name].tolist()


def test_a_larger_nudge_count_nudges_a_superset_of_a_smaller_ones() -> None:
    kv = random_kv()
    wire_name = f"layers.{faults.FAULT_LAYER}.k"
    sites = [{tuple(i) for i in changed(kv, apply(f"kv-ulp={n}", kv))[wire_name].tolist()} for n in (1, 4, 64, 512)]
    assert all(smaller < larger for smaller, larger in zip(sites, sites[1:], strict=False))


def test_more_nudges_than_elements_nudge_every_element_once() -> None:
    kv = random_kv(positions=100)
    faulty = apply("kv-ulp=65536", kv)
    assert changed(kv, faulty)[f"layers.{faults.FAULT_LAYER}.k"].shape[0] == HEADS * 100 * DIMS


def test_a_position_shift_rotates_every_key_and_nothing_else() -> None:
    kv = random_kv()
    faulty = apply("position-shift=0.001", kv)
    assert sorted(changed(kv, faulty)) == sorted(f"layers.{i}.k" for i in range(LAYERS))
    half = DIMS // 2
    for before, after in zip(kv.keys, faulty.keys, strict=True):  # a rotation keeps each pair's length
        norm = np.hypot(before[..., :half], before[..., half:])
        assert np.allclose(np.hypot(after[..., :half], after[..., half:]), norm, rtol=1e-5)


def test_position_shifts_compose_as_rotations() -> None:
    kv = random_kv()
    twice = apply("position-shift=2", apply("position-shift=1", kv))
    assert np.allclose(np.stack(twice.keys), np.stack(apply("position-shift=3", kv).keys), atol=1e-5)
    assert not same_bytes(apply("position-shift=1", kv), apply("position-shift=3", kv))


@pytest.mark.parametrize("span", [1, 5, 128, 358])
def test_a_block_swap_moves_only_k_inside_its_spans_and_is_an_involution(span: int) -> None:
    kv = random_kv()
    faulty = apply(f"block-swap={span}", kv)
    start = faults.BLOCK_SWAP_START
    differing = changed(kv, faulty)
    assert set(differing) == {f"layers.{i}.k" for i in range(LAYERS)}
    for where in differing.values():
        assert where[:, 1].min() >= start and where[:, 1].max() < start + 2 * span
    for before, after in zip(kv.keys, faulty.keys, strict=True):
        assert np.array_equal(after[:, start:start + span], before[:, start + span:start + 2 * span])
    assert same_bytes(apply(f"block-swap={span}", faulty), kv)


def test_a_block_swap_that_does_not_fit_hands_the_kv_off_unchanged() -> None:
    short = random_kv(positions=16)  # a warm-up prefill
    assert same_bytes(apply("block-swap=128", short), short)
    assert same_bytes(apply("block-swap=359", random_kv()), random_kv())  # 384 + 2 * 359 > 1100


@pytest.mark.parametrize(("span", "expected"), [(1, 1), (37, 37), (4096, POSITIONS)])
def test_a_head_swap_exchanges_two_heads_over_the_last_positions_and_is_an_involution(span: int, expected: int) -> None:
    kv = random_kv()
    faulty = apply(f"head-swap={span}", kv)
    first, second = faults.SWAPPED_HEADS
    differing = changed(kv, faulty)
    assert set(differing) == {f"layers.{faults.FAULT_LAYER}.k", f"layers.{faults.FAULT_LAYER}.v"}
    for before, after in ((kv.keys[faults.FAULT_LAYER], faulty.keys[faults.FAULT_LAYER]),
                          (kv.values[faults.FAULT_LAYER], faulty.values[faults.FAULT_LAYER])):
        start = POSITIONS - expected
        assert np.array_equal(after[first, start:], before[second, start:])
        assert np.array_equal(after[second, start:], before[first, start:])
        assert np.array_equal(after[:, :start], before[:, :start])
    assert same_bytes(apply(f"head-swap={span}", faulty), kv)


def test_an_element_scale_moves_exactly_the_kv_ulp_site() -> None:
    kv = random_kv()
    faulty = apply("element-scale=3", kv)
    site = (faults.FAULT_HEAD, faults.FAULT_POSITION, faults.FAULT_DIM)
    assert {name: where.tolist() for name, where in changed(kv, faulty).items()} == {
        f"layers.{faults.FAULT_LAYER}.k": [list(site)]}
    assert faulty.keys[faults.FAULT_LAYER][site] == np.float32(kv.keys[faults.FAULT_LAYER][site] * np.float32(3))
    assert changed(apply("kv-ulp=1", kv), kv).keys() == changed(faulty, kv).keys()


def test_a_last_position_scale_moves_k_and_v_of_the_last_position_in_every_layer() -> None:
    kv = random_kv()
    faulty = apply("last-position-scale=1.5", kv)
    differing = changed(kv, faulty)
    assert set(differing) == {f"layers.{i}.{t}" for i in range(LAYERS) for t in "kv"}
    for where in differing.values():
        assert set(where[:, 1].tolist()) == {POSITIONS - 1}
    for before, after in zip(kv.keys + kv.values, faulty.keys + faulty.values, strict=True):
        assert np.array_equal(after[:, -1], before[:, -1] * np.float32(1.5))


# 1.01, not 1.001: bfloat16 keeps 8 significant bits, so x * 1.001 rounds back to x there.
@pytest.mark.parametrize("name", ["v-scale=1.01", "k-scale=1.01", "kv-ulp=16", "position-shift=1",
                                  "block-swap=128", "head-swap=64", "element-scale=1.01",
                                  "last-position-scale=1.01"])
def test_a_corruption_keeps_the_dtype_and_leaves_its_input_alone(name: str) -> None:
    for dtype in (np.float32, ml_dtypes.bfloat16):
        kv = random_kv(dtype)
        copy = KVCache([k.copy() for k in kv.keys], [v.copy() for v in kv.values])
        faulty = apply(name, kv)
        assert {t.dtype for t in faulty.keys + faulty.values} == {np.dtype(dtype)}
        assert changed(kv, faulty)
        assert same_bytes(kv, copy)


def test_a_producer_with_a_valued_fault_hands_off_its_corruption(prompt: np.ndarray) -> None:
    from qualify.contract.lanes import ProducerMode
    from qualify.engines.factory import build_producer

    honest = build_producer("nvfp4-native-w4a4", ProducerMode.NATIVE)
    faulty = faults.faulty_producer(honest, "v-scale=1.001")
    tokens = prompt[:40]
    ours, theirs = faulty.prefill(tokens), honest.prefill(tokens)
    assert list(changed(theirs, ours)) == [f"layers.{faults.FAULT_LAYER}.v"]
    with pytest.raises(Refused, match="^fault v-scale: found '3'"):
        faults.faulty_producer(honest, "v-scale=3")


# ---- the detection-power bench's search ----------------------------------------------------------------


def _bench() -> object:
    path = Path(__file__).resolve().parents[3] / "bench" / "detection_power.py"
    spec = importlib.util.spec_from_file_location("detection_power_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("outcomes", "boundary", "non_monotone"), [
    ([False] * 13 + [True] * 8, 13, []),
    ([True] * 21, 0, []),
    ([False] * 21, None, []),
    ([False] * 20 + [True], 20, []),
    ([False] * 13 + [True, False] + [True] * 6, 13, [14]),  # missed just above the boundary
    ([False] * 11 + [True, False] + [True] * 8, 13, [11]),  # caught two below it
    ([False, True] + [False] * 11 + [True] * 8, 13, []),  # far below: a local check cannot see it
])
def test_the_search_finds_the_boundary_and_reports_what_breaks_monotonicity_next_to_it(
        outcomes: list[bool], boundary: int | None, non_monotone: list[int]) -> None:
    bench = _bench()
    probed: list[int] = []

    def caught(index: int) -> bool:
        probed.append(index)
        return outcomes[index]

    search = bench.bisect(len(outcomes), caught)  # type: ignore[attr-defined]
    assert (search.boundary, search.non_monotone) == (boundary, non_monotone)
    assert len(probed) == len(set(probed)) <= 8  # each value probed once, a handful in all
    assert search.seen == {index: outcomes[index] for index in probed}


@pytest.mark.parametrize(("argv", "message"), [
    (["--lanes", "nvfp4-exact"], "refused: --lanes: found 'nvfp4-exact', expected some of nvfp4-native-w4a4, "),
    (["--lanes", ""], "refused: --lanes: found '', expected some of "),
    (["--classes", "v-scale,bit-rot"], "refused: --classes: found 'v-scale,bit-rot', expected some of v-scale, k-scale, "),
    (["--bounds", "1.3"], "refused: --bounds: found '1.3', expected MAX,MEAN (two positive finite numbers)"),
    (["--bounds", "1.3,nan"], "refused: --bounds: found '1.3,nan', expected MAX,MEAN"),
    (["--bounds", "0,0.1"], "refused: --bounds: found '0,0.1', expected MAX,MEAN"),
])
def test_the_bench_refuses_a_bad_option_in_one_line_before_building_anything(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bench = _bench()
    assert bench.main([*argv, "--out", str(tmp_path / "out.json")]) == 2  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "out.json").exists()
