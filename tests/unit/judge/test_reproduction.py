"""Seed 000's G3 recheck (a run's deterministic digests against its fixture anchor), the host
refusal before any handoff, and the calibration's environment matrix."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qualify.core import assets
from qualify.engines.factory import build_producer
from qualify.judge import DRAFT_REPRODUCTION_FIELDS, REPRODUCTION_FIELDS, judge_reproduction
from qualify.run import calibrate as calibration

REPO = Path(__file__).resolve().parents[3]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def record(repetition: int, **overrides: str) -> dict:
    fields = {name: digest(name) for name, _ in REPRODUCTION_FIELDS + DRAFT_REPRODUCTION_FIELDS}
    fields.update(overrides)
    return {"repetition": repetition, **fields}


BASIS = [record(1), record(2), record(3), record(4), record(5)]


def test_equal_digests_reproduce_the_anchor() -> None:
    verdict = judge_reproduction([record(1), record(2), record(3)], BASIS, rung=2,
                                 deterministic_producer=True, draft=True)
    assert verdict.passed
    assert verdict.headline.startswith("reproduced its anchor bit for bit")
    assert len(verdict.checks) == len(REPRODUCTION_FIELDS) + len(DRAFT_REPRODUCTION_FIELDS)


@pytest.mark.parametrize(("name", "words"), REPRODUCTION_FIELDS)
def test_any_changed_digest_fails_rung_3(name: str, words: str) -> None:
    changed = [record(1), record(2, **{name: digest("other")}), record(3)]
    verdict = judge_reproduction(changed, BASIS, rung=3, deterministic_producer=True, draft=False)
    assert not verdict.passed
    assert words in verdict.headline and "rung 3 requires it" in verdict.headline
    failing = [check for check in verdict.checks if not check.passed]
    assert [check.name for check in failing] == [f"{words} as anchored"]
    assert "repetition 2" in failing[0].detail


def test_rung_2_deterministic_producer_fails_saying_the_output_changed() -> None:
    changed = [record(1, payload_sha256=digest("new")), record(2), record(3)]
    verdict = judge_reproduction(changed, BASIS, rung=2, deterministic_producer=True, draft=False)
    assert not verdict.passed
    assert "the producer's output changed since calibration" in verdict.headline


def test_rung_2_nondeterministic_producer_reports_without_failing() -> None:
    changed = [record(1, payload_sha256=digest("new")), record(2), record(3)]
    verdict = judge_reproduction(changed, BASIS, rung=2, deterministic_producer=False, draft=False)
    assert verdict.passed
    assert verdict.headline.startswith("did not reproduce its anchor bit for bit: payload tree")


def test_draft_digests_count_only_on_a_lane_with_a_draft() -> None:
    changed = [record(1, handoff_draft_trace_sha256=digest("new")), record(2), record(3)]
    assert judge_reproduction(changed, BASIS, rung=3, deterministic_producer=True, draft=False).passed
    assert not judge_reproduction(changed, BASIS, rung=3, deterministic_producer=True, draft=True).passed


@pytest.mark.parametrize("basis", [
    [record(1), record(2, seams_sha256=digest("other"))],  # the basis disagrees with itself
    [record(1, seams_sha256=None), record(2, seams_sha256=None)],  # a basis from before seams were recorded
    [],
])
def test_a_basis_that_cannot_vouch_fails_closed(basis: list) -> None:
    verdict = judge_reproduction([record(1), record(2), record(3)], basis, rung=2,
                                 deterministic_producer=True, draft=False)
    assert not verdict.passed


def test_no_samples_is_not_a_reproduction() -> None:
    assert not judge_reproduction([], BASIS, rung=2, deterministic_producer=True, draft=False).passed


@pytest.mark.parametrize("basis", [
    [record(1), record(2, seams_sha256=digest("other"))],
    [record(1, seams_sha256=None), record(2, seams_sha256=None)],
])
def test_an_anchor_that_cannot_vouch_for_one_digest_fails_that_check_and_still_compares_the_rest(basis: list) -> None:
    verdict = judge_reproduction([record(1), record(2), record(3)], basis, rung=2, deterministic_producer=False,
                                 draft=False)
    assert [(check.name, check.passed) for check in verdict.checks if not check.passed] == [
        ("per-layer seams as anchored", False)]
    assert len(verdict.checks) == len(REPRODUCTION_FIELDS)
    assert verdict.passed  # rung 2, a producer not declared deterministic: reported, not failed


@pytest.mark.parametrize("basis", [[], [record(1), record(2), "not a record"]], ids=["empty", "unreadable-sample"])
def test_a_basis_with_an_unreadable_anchor_sample_is_no_anchor(basis: list) -> None:
    verdict = judge_reproduction([record(1), record(2), record(3)], basis, rung=2, deterministic_producer=True,
                                 draft=False)
    assert not verdict.passed
    assert (verdict.checks[0].name, verdict.checks[0].passed) == ("anchor samples", False)
    assert [check.name for check in verdict.checks if not check.passed] == ["anchor samples"]
    assert len(verdict.checks) == (1 if not basis else 1 + len(REPRODUCTION_FIELDS))


def test_every_changed_digest_is_its_own_failing_check_and_the_others_still_pass() -> None:
    run = [record(1, seams_sha256=digest("b"), payload_sha256=digest("9")), record(2, seams_sha256=digest("b")), record(3)]
    for deterministic in (False, True):
        verdict = judge_reproduction(run, BASIS, rung=2, deterministic_producer=deterministic, draft=False)
        assert len(verdict.checks) == len(REPRODUCTION_FIELDS)
        assert [check.name for check in verdict.checks if not check.passed] == ["payload tree as anchored",
                                                                                "per-layer seams as anchored"]
        assert verdict.passed is not deterministic


def test_calibration_environments_vary_kernel_threads_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.core import hostenv
    monkeypatch.setattr(hostenv, "cpu_flags", lambda: frozenset({"avx", "avx2", "avx512f"}))
    monkeypatch.setattr(hostenv, "numpy_narrower_dispatch", lambda: "AVX512F,AVX512_SKX")
    environments = calibration.calibration_environments()
    assert environments[0] == {}  # the first handoff runs as the operator set it
    kernels = {env.get("OPENBLAS_CORETYPE") for env in environments}
    assert {"Haswell", "Prescott", "Sandybridge"} <= kernels
    assert {env.get("OPENBLAS_NUM_THREADS") for env in environments} >= {"1", "2"}
    assert [env["NPY_DISABLE_CPU_FEATURES"] for env in environments if "NPY_DISABLE_CPU_FEATURES" in env] \
        == ["AVX512F,AVX512_SKX"] * 2
    monkeypatch.setattr(hostenv, "cpu_flags", lambda: frozenset({"avx"}))
    monkeypatch.setattr(hostenv, "numpy_narrower_dispatch", lambda: "")
    without_avx2 = calibration.calibration_environments()
    assert all(env.get("OPENBLAS_CORETYPE") != "Haswell" for env in without_avx2)
    assert all("NPY_DISABLE_CPU_FEATURES" not in env for env in without_avx2)
    assert len(without_avx2) == len(environments) - 1


def test_numpy_narrower_dispatch_names_features_numpy_uses_here() -> None:
    from numpy._core._multiarray_umath import __cpu_features__

    from qualify.core.hostenv import numpy_narrower_dispatch

    narrower = numpy_narrower_dispatch()
    assert all(__cpu_features__[name] for name in narrower.split(",") if name)
    if __cpu_features__.get("AVX512F"):
        assert "AVX512F" in narrower.split(",") and "AVX2" not in narrower.split(",")


# ---- the host refusal ----------------------------------------------------------------------


def test_a_host_whose_arithmetic_gives_other_bits_is_refused_at_the_first_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A consumer whose prefill runs other query blocks (other bits, same ABI name): exit 2 at
    'identity sealed' in one line naming both known-answer digests; no handoff runs."""
    import json

    from qualify.engines import reference
    from qualify.interfaces import cli

    monkeypatch.setattr(reference, "PREFILL_QUERY_BLOCK", 64)
    monkeypatch.setattr(reference, "CAUSAL_SQUARE", reference.CAUSAL_SQUARE[:64, :64])
    pinned = json.loads((assets.CONTRACTS_DIR / "nvfp4-native-w4a4-identity-v1.json").read_bytes())
    code = cli.main(["--recipe", "native-text", "--receipts", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    refusal = [line for line in err.splitlines() if pinned["consumer_engine"]["kat_sha256"] in line]
    assert len(refusal) == 1 and "identity sealed" in out
    assert "handoff 1/3" not in out or "blocked" in out


# ---- determinism across a restart and A/B/A interleaving ----------------------------------

PROBE = """
import hashlib, sys
import numpy as np
from qualify.core import assets
from qualify.engines.factory import build_producer
prompt = assets.load_prompt()
for lane in sys.argv[1:]:
    engine = build_producer(lane, "native")
    kv = engine.prefill(prompt[:400])
    result = engine.decode(kv, prompt[400:401], 8)
    h = hashlib.sha256()
    for array in (*kv.keys, *kv.values, result.tokens, result.logits):
        h.update(np.ascontiguousarray(array).tobytes())
    print(lane, h.hexdigest())
"""


def engine_digest(engine, prompt: np.ndarray) -> str:
    kv = engine.prefill(prompt[:400])
    result = engine.decode(kv, prompt[400:401], 8)
    h = hashlib.sha256()
    for array in (*kv.keys, *kv.values, result.tokens, result.logits):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_lanes_alternating_on_one_producer_and_across_a_restart_give_the_same_bits() -> None:
    prompt = assets.load_prompt()
    lane_a, lane_b = "nvfp4-native-w4a4", "nvfp4-native-splitk"
    engine_a, engine_b = build_producer(lane_a, "native"), build_producer(lane_b, "native")
    first_a = engine_digest(engine_a, prompt)
    only_b = engine_digest(engine_b, prompt)
    second_a = engine_digest(engine_a, prompt)
    assert first_a == second_a != only_b
    restarted = subprocess.run([sys.executable, "-c", PROBE, lane_b, lane_a], cwd=REPO, capture_output=True,
                               text=True, timeout=300, check=True).stdout.split()
    assert dict(zip(restarted[::2], restarted[1::2], strict=True)) == {lane_a: first_a, lane_b: only_b}
