"""Real vLLM lanes through the project KV connector (``pytest -m vllm`` in .venv-vllm).

Skipped with a reason where vLLM is not importable (conftest). Each lane run starts a real vLLM
producer process (about 15 s) and, for a vLLM consumer, a second vLLM engine in this process.

vLLM's numbers depend on the host's CPU class, so each shipped vLLM identity pins it (in the
engine ABIs). The tests that run a shipped identity first ask whether this host builds the engines
it pins (:func:`host_match`): where it does, the lane qualifies; where it does not, the run must be
refused at "identity sealed" naming the field and the calibrate command, and the fault tests,
which need a qualifying lane, are skipped. The refusal is also tested on every host by simulating
another CPU class, and calibrate -> freeze -> qualify runs on whatever host runs the tests.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

from qualify.archive.verify import verify_receipt  # noqa: E402
from qualify.contract.lanes import lane_spec  # noqa: E402
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions  # noqa: E402

HANDOFF_POSITIONS = 1920  # whole 128-token blocks of the 2047 handed-off prompt tokens
REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, producer: str, consumer: str, engine_factory: str | None = None,
         stop_at_first_failure: bool = True) -> QualificationRun:
    options = RunOptions(recipe="native-text", producer=producer, consumer=consumer,
                         reference_once=True, receipts=tmp_path, engine_factory=engine_factory,
                         command_line=["pytest", "tests/vllm/test_vllm_lanes.py"])
    run = QualificationRun(options)
    try:
        for label in STEP_LABELS:
            outcome = run.step(label)
            if not outcome.passed and stop_at_first_failure:
                break
    finally:
        run.close()
    return run


# -- does this host build the engines a shipped identity pins? ----------------------------------


@dataclass(frozen=True)
class HostMatch:
    """This host's engines against a shipped identity's pins, in the order
    ``qualify.run.run_contract.check_engine_pins`` compares them; ``differing`` names the fields that differ."""

    lane: str
    found: dict[str, str]
    pinned: dict[str, str]
    unpinned_known_answers: tuple[str, ...] = ()
    """The vLLM engines' ``kat_sha256`` fields the identity leaves null (frozen before vLLM known
    answers): refused at 'identity sealed' once the ABIs match."""

    @property
    def differing(self) -> list[str]:
        return [name for name in self.found if self.found[name] != self.pinned[name]]

    @property
    def matches(self) -> bool:
        return not self.differing and not self.unpinned_known_answers

    def describe(self) -> str:
        return "; ".join([*(f"{name}: this host {self.found[name]!r}, the identity pins {self.pinned[name]!r}"
                            for name in self.differing),
                          *(f"{name}: the identity pins none" for name in self.unpinned_known_answers)]
                         ) or "this host builds the pinned engines"


_HOST_MATCHES: dict[str, HostMatch] = {}


def host_match(lane: str) -> HostMatch:
    """Compare the engines this host builds for ``lane`` with its shipped identity's pins, without
    starting vLLM: the producer's ABI from ``factory.lane_producer_abi``; a vLLM consumer's name,
    version and ABI from ``VllmEngine.name``, ``check_pin`` and ``vllm_engine_abi``; the numpy
    consumer's from ``factory.build_consumer`` (cheap). Computed once per lane per session."""
    if lane not in _HOST_MATCHES:
        from qualify.contract.lanes import VLLM_LANE_ENGINES
        from qualify.engines import factory
        from qualify.run.run_contract import identity_path_for_lane

        document = json.loads(identity_path_for_lane(lane).read_text(encoding="utf-8"))
        if VLLM_LANE_ENGINES[lane][1] == "vllm":
            from qualify.engines.vllm_engine import VllmEngine, check_pin, vllm_engine_abi

            consumer = (VllmEngine.name, check_pin(), vllm_engine_abi())
        else:
            engine = factory.build_consumer(lane_spec(lane))
            consumer = (engine.name, engine.version, engine.abi)
        found = {"producer_engine.abi": factory.lane_producer_abi(lane_spec(lane)), "consumer_engine.name": consumer[0],
                 "consumer_engine.version": consumer[1], "consumer_engine.abi": consumer[2]}
        pinned = {name: document[name.split(".")[0]][name.split(".")[1]] for name in found}
        unpinned = tuple(f"{role}.kat_sha256" for role in ("producer_engine", "consumer_engine")
                         if document[role]["name"] == "vllm" and document[role]["kat_sha256"] is None)
        _HOST_MATCHES[lane] = HostMatch(lane, found, pinned, unpinned)
    return _HOST_MATCHES[lane]


def require_qualifying_host(lane: str) -> None:
    """Skip a test that needs ``lane``'s shipped identity to qualify on a host it does not pin."""
    match = host_match(lane)
    if not match.matches:
        pytest.skip(f"{lane}: the shipped identity is calibrated for another numeric environment "
                    f"({match.describe()}); it is refused here at 'identity sealed' (tested by "
                    f"test_lane_passes_native_text and test_another_cpu_class_is_refused_at_the_first_step); "
                    f"test_calibrate_freeze_qualify_on_this_host qualifies the lane on this host")


def assert_refused_for_this_host(run: QualificationRun, match: HostMatch) -> None:
    """The run of a shipped identity on a host it does not pin: exit 2 at 'identity sealed', naming
    the first differing field, both values and the calibrate command; no producer, no handoff."""
    outcome = run.outcomes["identity sealed"]
    assert run.refused and not outcome.passed, run.outcomes
    if not match.differing:  # the engines match; the identity pins no vLLM known answer
        assert f"{match.unpinned_known_answers[0]}: pinned none" in outcome.message, outcome.message
        assert list(run.outcomes) == ["identity sealed"] and not run.records, run.outcomes
        return
    field = match.differing[0]
    assert field in ("producer_engine.abi", "consumer_engine.name", "consumer_engine.version",
                     "consumer_engine.abi")
    assert f"identity {match.lane}: {field}: found {match.found[field]!r} on this host, expected " \
           f"{match.pinned[field]!r}" in outcome.message, outcome.message
    assert outcome.message.endswith(
        f"to calibrate it for this host: qualify calibrate --recipe native-text --lane {match.lane}"), outcome.message
    assert list(run.outcomes) == ["identity sealed"], run.outcomes
    assert not run.records  # no handoff; the refusal's own receipt (every run leaves one) verifies
    assert run.receipt_path is not None and verify_receipt(run.receipt_path) == []


# -- the page layout (no engine) ---------------------------------------------------------------


def test_page_layout_round_trip_and_refusals():
    import torch

    from qualify.engines.vllm_connector import (
        KNOWN_LAYOUT,
        LayoutRefused,
        check_layout,
        decode_blocks,
        encode_blocks,
        layer_index,
    )

    heads, block, dim, blocks = 4, 128, 32, 6
    pages = torch.zeros((blocks, heads, block, 2 * dim), dtype=torch.float32)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((heads, 3 * block, dim)).astype(np.float32)
    values = rng.standard_normal((heads, 3 * block, dim)).astype(np.float32)
    encode_blocks(pages, [4, 1, 2], keys, values)
    # Physically: per (block, head) K transposed [dim, block] then V [block, dim].
    page = pages[4, 0].reshape(-1).numpy()
    assert np.array_equal(page[: block * dim].reshape(dim, block), keys[0, :block].T)
    assert np.array_equal(page[block * dim:].reshape(block, dim), values[0, :block])
    k, v = decode_blocks(pages, [4, 1, 2], dim)
    assert np.array_equal(k, keys) and np.array_equal(v, values)
    assert check_layout(pages, block_size=block, kv_heads=heads, head_dim=dim, isa="vec") == KNOWN_LAYOUT
    for isa, tensor, match in (
        ("amx", pages, "ISA 'amx'"),
        ("vec", pages.to(torch.bfloat16), "dtype"),
        ("vec", pages.transpose(1, 2), "shape"),
        ("vec", pages.transpose(2, 3).contiguous().transpose(2, 3), "strides"),
    ):
        with pytest.raises(LayoutRefused, match=match):
            check_layout(tensor, block_size=block, kv_heads=heads, head_dim=dim, isa=isa)
    assert layer_index("model.layers.3.self_attn.attn") == 3
    with pytest.raises(LayoutRefused):
        layer_index("lm_head")


def test_version_pin_refuses_another_vllm(monkeypatch):
    from qualify.core.errors import Refused
    from qualify.engines import vllm_engine

    monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: "0.31.9")
    with pytest.raises(Refused, match="installed version 0.31.9, this harness pins 0.32.0"):
        vllm_engine.VllmEngine()


def test_a_misread_page_layout_is_refused_at_start(monkeypatch):
    """The engine tests the connector's decode against the reference engine's KV at start: K read
    without the CPU backend's per-block transpose is refused, never guessed."""
    import torch

    from qualify.core.errors import Refused
    from qualify.engines import vllm_connector, vllm_engine

    def untransposed(kv_layer, block_ids, head_dim):
        _, heads, block_size, _ = kv_layer.shape
        pages = kv_layer.index_select(0, torch.as_tensor(block_ids)).reshape(
            len(block_ids), heads, 2, block_size, head_dim)
        k = pages[:, :, 0].permute(1, 0, 2, 3).reshape(heads, -1, head_dim)
        v = pages[:, :, 1].permute(1, 0, 2, 3).reshape(heads, -1, head_dim)
        return np.ascontiguousarray(k.numpy()), np.ascontiguousarray(v.numpy())

    monkeypatch.setattr(vllm_connector, "decode_blocks", untransposed)
    with pytest.raises(Refused, match="layer 0 K differs .* layout not recognised"):
        vllm_engine.VllmEngine()


# -- the ABI pins the CPU class and the numeric environment the harness fixes ------------------


def test_abi_names_the_cpu_class_and_the_pinned_threads():
    import torch

    from qualify.core import hostenv
    from qualify.engines import vllm_engine

    abi = vllm_engine.vllm_engine_abi()
    expected = (f"+cpu-{hostenv.cpu_isa_class()}+aten-{torch.backends.cpu.get_cpu_capability()}"
                f"+threads-{vllm_engine.THREADS}+env-{vllm_engine.numeric_environment_sha256()[:12]}")
    assert abi.endswith(expected), abi
    assert abi.startswith(f"{vllm_engine.VLLM_DISTRIBUTION}-{vllm_engine.VLLM_PIN}+"), abi
    assert vllm_engine.ENV["OMP_NUM_THREADS"] == str(vllm_engine.THREADS)
    assert torch.get_num_threads() == vllm_engine.THREADS  # computing the ABI pinned this process


def test_the_harness_overrides_the_operators_numeric_environment(monkeypatch):
    import torch

    from qualify.engines import vllm_engine

    operator = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "VLLM_CPU_ATTN_SPLIT_KV": "0",
                "VLLM_FLOAT32_MATMUL_PRECISION": "medium", "ATEN_CPU_CAPABILITY": "avx2",
                "ONEDNN_DEFAULT_FPMATH_MODE": "BF16", "VLLM_SOMETHING_NEW": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    for key, value in operator.items():
        monkeypatch.setenv(key, value)
    torch._C.set_num_threads(2)
    vllm_engine.pin_numeric_environment()
    assert {key: os.environ.get(key) for key in vllm_engine.ENV} == vllm_engine.ENV
    assert not [key for key in vllm_engine.ENV_REMOVED if key in os.environ]
    assert "VLLM_SOMETHING_NEW" not in os.environ
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # logging is the operator's
    assert torch.get_num_threads() == vllm_engine.THREADS


_BITS_SCRIPT = """
import hashlib, json, sys
import numpy as np
from qualify.core import assets
from qualify.engines.vllm_engine import VllmEngine
from qualify.core.kv import KVCache
engine = VllmEngine()
prompt = assets.load_prompt()
kv = engine.prefill(prompt[:1099])  # 8 whole blocks handed off; the cold branch keeps all 1099
handed = KVCache([k.copy() for k in kv.keys], [v.copy() for v in kv.values])
digest = lambda arrays: hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
warm = engine.decode(handed, np.asarray(prompt[1024:1100]), 8)
cold = engine.decode(kv, np.asarray(prompt[1099:1100]), 8)
print("BITS " + json.dumps({"abi": engine.abi, "kv": digest(kv.keys + kv.values),
      "handoff": digest([warm.tokens, warm.logits]), "cold": digest([cold.tokens, cold.logits])}))
"""


def test_engine_bits_do_not_depend_on_the_operators_environment():
    """Two engine processes, one under an operator environment that changes vLLM's arithmetic
    when honoured (2 threads: other KV and logits; split-KV attention off: other decode logits),
    give bit-identical KV, handed-off decode and cold decode, and the same ABI."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "OMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_"))}
    operator = {"OMP_NUM_THREADS": "2", "VLLM_CPU_ATTN_SPLIT_KV": "0", "OPENBLAS_CORETYPE": "Haswell"}
    results = []
    for env in (base, {**base, **operator}):
        done = subprocess.run([sys.executable, "-c", _BITS_SCRIPT], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("BITS ")]
        assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-2000:]
        results.append(json.loads(lines[-1][5:]))
    assert results[0] == results[1]
    # One thread: the handed-off decode equals the cold recompute bit for bit.
    assert results[0]["handoff"] == results[0]["cold"]


# -- one vLLM engine per process ------------------------------------------------------------------


def test_a_new_engine_shuts_the_previous_one_down(monkeypatch):
    """vLLM keeps its distributed groups and the worker's KV connector in process globals, and an
    engine's finalizer tears them down whenever the engine is collected. Before the fix, an engine
    collected while the next one was starting left it without its tensor parallel group
    ("tensor model parallel group is not initialized"), and an engine built while a fault engine
    was alive exported through the fault engine's connector."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    from qualify.core import assets
    from qualify.engines import vllm_connector as c
    from qualify.engines import vllm_engine
    from qualify.engines.reference import ReferenceEngine

    prompt = assets.load_prompt()[: c.FAULT_POSITION + 100]
    holder = [vllm_engine.VllmEngine(fault="k-bit-flip")]
    first = weakref.ref(holder[0])
    real = gpu_worker.ensure_kv_transfer_initialized

    def previous_engine_collected_meanwhile(*args, **kwargs):
        holder.clear()
        gc.collect()
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_worker, "ensure_kv_transfer_initialized", previous_engine_collected_meanwhile)
    clean = vllm_engine.VllmEngine()
    if first() is not None:  # still referenced somewhere (a logged traceback): closed all the same
        assert first().llm is None
        with pytest.raises(RuntimeError, match="vllm engine closed"):
            first().prefill(prompt)
    gc.collect()
    kv = clean.prefill(prompt)  # works, through its own (fault-free) connector
    site = (c.FAULT_HEAD, c.FAULT_POSITION, c.FAULT_DIM)
    reference = ReferenceEngine.from_model_dir(assets.MODEL_DIR).prefill(prompt)
    assert abs(kv.keys[c.FAULT_LAYER][site] - reference.keys[c.FAULT_LAYER][site]) < 1e-4
    clean.close()
    clean.close()  # idempotent


# -- the three lanes pass native-text ----------------------------------------------------------


@pytest.mark.parametrize("producer,consumer,lane", [
    ("vllm", "reference", "vllm-to-reference"),
    ("vllm", "vllm", "vllm-to-vllm"),
    ("reference", "vllm", "reference-to-vllm"),
])
def test_lane_passes_native_text(tmp_path, producer, consumer, lane):
    """The shipped identity qualifies on the CPU class it pins, and is refused (exit 2 at the first
    step, naming the calibrate command) on any other."""
    match = host_match(lane)
    run = _run(tmp_path, producer, consumer)
    if not match.matches:
        assert_refused_for_this_host(run, match)
        return
    assert run.contract.lane == lane
    assert run.verdict is not None and run.verdict.passed, run.outcomes
    for record in run.records:
        assert record["handed_off_positions"] == HANDOFF_POSITIONS
        assert record["recomputed_positions"] == 2048 - HANDOFF_POSITIONS
        assert record["token_agreement_rate"] == 1.0
        assert 0 <= record["max_abs"] < 1e-3  # vllm-to-vllm is bit-exact: 0.0
    assert verify_receipt(run.receipt_path) == []


# -- connector faults are caught and localised -------------------------------------------------


def _failed(run: QualificationRun) -> dict:
    assert run.verdict is not None and not run.verdict.passed
    return next(r for r in run.records if r.get("error") or r.get("localisation"))


def _over(record: dict) -> list[tuple[int, str, int | None]]:
    items = (record.get("localisation") or {}).get("kv_over_envelope") or []
    return [(item["layer"], item["tensor"], item.get("position")) for item in items]


def test_k_bit_flip_after_compute_is_localised_to_its_layer(tmp_path):
    require_qualifying_host("vllm-to-reference")
    from qualify.engines import vllm_connector as c

    run = _run(tmp_path, "vllm", "reference", "qualify.engines.fault_factories:build_k_bit_flip_producer")
    over = _over(_failed(run))
    assert [(layer, tensor) for layer, tensor, _ in over] == [(c.FAULT_LAYER, "K")], over
    assert over[0][2] == c.FAULT_POSITION


def test_wrong_block_order_is_localised_to_the_swapped_positions(tmp_path):
    require_qualifying_host("vllm-to-reference")
    from qualify.engines import vllm_connector as c

    run = _run(tmp_path, "vllm", "reference", "qualify.engines.fault_factories:build_block_order_producer")
    over = _over(_failed(run))
    low, high = c.SWAPPED_BLOCKS[0] * 128, (c.SWAPPED_BLOCKS[1] + 1) * 128
    assert over and {layer for layer, _, _ in over} == {0, 1, 2, 3}, over
    assert all(p is not None and low <= p < high for _, _, p in over), over


def test_other_prompts_kv_is_caught_from_layer_0(tmp_path):
    require_qualifying_host("vllm-to-reference")
    run = _run(tmp_path, "vllm", "reference", "qualify.engines.fault_factories:build_other_prompt_producer")
    record = _failed(run)
    assert {(0, "K"), (0, "V")} <= {(layer, tensor) for layer, tensor, _ in _over(record)}


def test_engine_raising_mid_request_gives_a_failing_receipt(tmp_path):
    require_qualifying_host("vllm-to-reference")
    run = _run(tmp_path, "vllm", "reference", "qualify.engines.fault_factories:build_raising_producer")
    assert run.verdict is not None and not run.verdict.passed
    assert run.receipt_path is not None and verify_receipt(run.receipt_path) == []
    assert run.outcomes["producer ready"].passed  # the warm-up request was served
    errors = [r.get("error") or "" for r in run.records]
    assert errors and "producer failed" in errors[0] and "saving layer 2" in errors[0], errors


def test_pd_lane_catches_kv_of_another_position_range(tmp_path, monkeypatch):
    """vLLM #52617: the consumer "retrieves all tokens", but the KV it installs belongs to another
    position range (here one block later). Every handed-off byte verified; the decode is caught."""
    require_qualifying_host("vllm-to-vllm")
    from qualify.engines import factory

    real = factory.build_consumer
    monkeypatch.setattr(factory, "build_consumer",
                        lambda lane, vllm_fault=None: real(lane, vllm_fault="shift-install"))
    run = _run(tmp_path, "vllm", "vllm")
    assert run.verdict is not None and not run.verdict.passed and not run.refused
    record = run.records[0]
    assert record["handed_off_positions"] == HANDOFF_POSITIONS
    # The handoff itself was right (the producer's bytes equal the fixture anchor's, the KV within
    # the envelope); the consumer's use of it was not. On this small model the far context
    # barely moves the logits (tokens can stay exact), so it is the decode's logits that catch it:
    # the lane's drift bound (bit-exact here) or the anchor recheck of the handoff's logits.
    assert not _over(record)
    failed = {check.name for check in run.verdict.checks if not check.passed}
    assert "payload tree as anchored" not in failed and "per-layer seams as anchored" not in failed
    assert failed & {"bounded drift", "handoff logit block as anchored"} or record["token_agreement_rate"] < 1.0, failed


# -- another CPU class is refused; this host calibrates, freezes and qualifies ------------------


def test_another_cpu_class_is_refused_at_the_first_step(tmp_path, capsys):
    """On a host of another CPU class (simulated: ``hostenv.cpu_isa_class`` patched, so the vLLM
    ABI names another class), the shipped vllm-to-reference identity is refused: exit 2 at
    'identity sealed', naming producer_engine.abi, both CPU classes and the calibrate command;
    no producer starts, no handoff runs, no receipt is written. Runs on every host."""
    from qualify.core import hostenv
    from qualify.engines import vllm_engine
    from qualify.interfaces import cli
    from qualify.run.run_contract import identity_path_for_lane

    lane = "vllm-to-reference"
    pinned = json.loads(identity_path_for_lane(lane).read_text(encoding="utf-8"))["producer_engine"]["abi"]
    # The ABI is '...+<page layout, itself cpu-...>+cpu-<ISA class>+aten-<level>+...'.
    pinned_class = pinned.partition("+aten-")[0].rpartition("+cpu-")[2]
    other_class = "x86_64+avx2" if pinned_class != "x86_64+avx2" else "x86_64"
    vllm_engine.vllm_engine_abi.cache_clear()  # functools.cache: the ABI is computed once per process
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hostenv, "cpu_isa_class", lambda: other_class)
            assert f"+cpu-{other_class}+aten-" in vllm_engine.vllm_engine_abi()
            code = cli.main(["--recipe", "native-text", "--producer", "vllm", "--receipts", str(tmp_path)])
    finally:
        vllm_engine.vllm_engine_abi.cache_clear()
    assert f"+cpu-{hostenv.cpu_isa_class()}+aten-" in vllm_engine.vllm_engine_abi()  # the real class again
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    text = " ".join((out + err).split())
    compact = "".join((out + err).split())  # the console folds lines longer than its width
    assert f"identity {lane}: producer_engine.abi: found" in text, text
    assert f"+cpu-{other_class}+aten-" in compact and repr(pinned) in compact, text
    assert f"to calibrate it for this host: qualify calibrate --recipe native-text --lane {lane}" in text, text
    # Nothing after the first step ran: every later step is blocked by it. The refusal has its
    # receipt (the lane cannot run on this host), marked refused, with no sample.
    assert text.count("blocked: step 'identity sealed' failed") == 1, text  # one "not run" line names them
    assert "sample 1" not in text and "QUALIFIED" not in text
    from qualify.archive.verify import verify_receipt

    receipts = list(tmp_path.iterdir())
    assert len(receipts) == 1 and verify_receipt(receipts[0]) == []
    summary = json.loads((receipts[0] / "validation-summary.json").read_text(encoding="utf-8"))
    assert summary["error"].startswith("refused: identity sealed: identity vllm-to-reference: producer_engine.abi")
    assert summary["samples"] == 0


def test_calibrate_freeze_qualify_on_this_host(tmp_path, monkeypatch, capsys):
    """What CI runs on whatever host it has: calibrate vllm-to-reference here (2 handoffs, the second
    from a producer restarted under another environment), freeze an identity from that
    calibration with tools/freeze_identity.py, seal it (in this process only: the shipped sealed
    table and contracts are untouched) and qualify it: exit 0, reproducing the calibration bit for
    bit. Five to six minutes on two cores (three producer starts, cold recomputes and decodes in
    numpy), so it runs where the shipped identity does not cover this host: there it is what the
    lane tests skipped above point to. Where the shipped identity covers the host, the lane qualifies
    under it above, and the calibrate, freeze, seal and qualify chain on vLLM engines runs in
    tests/vllm/test_connector_qualify.py."""
    lane = "vllm-to-reference"
    match = host_match(lane)
    if match.matches:
        pytest.skip(f"{lane}: the shipped identity covers this host, and qualifies here "
                    "(test_lane_passes_native_text); calibrate, freeze, seal and qualify on vLLM engines run "
                    "in tests/vllm/test_connector_qualify.py")
    import contextlib
    import io

    from qualify.contract import identity as identity_module
    from qualify.contract import sealed_data
    from qualify.engines import factory
    from qualify.interfaces import cli
    from qualify.run.calibrate import calibrate

    receipts = tmp_path / "receipts"

    # (a) calibrate: the calibration set's cells, then the fixture anchors reproduced across a
    # restart and another environment, the fixture's tokens exact.
    calibration = calibrate(lane_spec(lane), "native-text", RunOptions(
        recipe="native-text", receipts=receipts,
        command_line=["qualify", "calibrate", "--recipe", "native-text", "--lane", lane]))
    assert not calibration.failures, calibration.failures
    assert calibration.passed and calibration.tokens_exact and calibration.deterministic, calibration.headline
    assert calibration.proposed_maximum_absolute and calibration.proposed_maximum_mean_absolute
    assert calibration.receipt_path is not None and calibration.receipt_path.parent == receipts
    assert verify_receipt(calibration.receipt_path) == []

    # (b) freeze with the tool. The engine pins are what the harness derives on this host (the
    # producer's without starting vLLM here; the service checks it against its real engine).
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import freeze_identity

    producer, consumer = factory.producer_facts(lane_spec(lane)), factory.build_consumer(lane_spec(lane))
    identity_path = tmp_path / "identity.json"
    argv = ["--lane", lane, "--basis", f"receipt://{calibration.receipt_path.name}/command.log",
            "--maximum-absolute", repr(calibration.proposed_maximum_absolute),  # given: it must equal the derived
            "--producer-engine", producer.name, producer.version, producer.abi,
            "--consumer-engine", consumer.name, consumer.version, consumer.abi,
            "--archive-dir", str(receipts), "--out", str(identity_path)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = freeze_identity.main(argv)
    assert status == 0, capsys.readouterr().err
    document = freeze_identity.build_document(freeze_identity.build_parser().parse_args(argv))
    assert json.loads(identity_path.read_text(encoding="utf-8")) == document
    frozen = identity_module.parse_identity_document(document, where=f"identity {identity_path}")
    seal = freeze_identity.seal_of(frozen, receipts)
    assert freeze_identity.sealed_lines(lane, seal) in printed.getvalue()
    assert frozen.producer_engine.abi == factory.lane_producer_abi(lane_spec(lane))

    # (c) seal it for this process: the lane's entry replaced, the basis resolved in tmp_path.
    monkeypatch.setattr(sealed_data, "SEALED_IDENTITIES", {**sealed_data.SEALED_IDENTITIES, lane: seal.identity_sha256})
    monkeypatch.setattr(sealed_data, "SEALED_BASIS_MANIFESTS",
                        {**sealed_data.SEALED_BASIS_MANIFESTS, lane: seal.basis_manifest_sha256})
    monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", receipts)

    # (d) qualify it.
    runs = tmp_path / "runs"
    capsys.readouterr()
    code = cli.main(["--recipe", "native-text", "--producer", "vllm", "--identity", str(identity_path),
                     "--receipts", str(runs), "--reference-once"])
    out, err = capsys.readouterr()
    assert code == 0, out[-4000:] + err[-2000:]
    (receipt,) = list(runs.iterdir())
    assert verify_receipt(receipt) == []
    summary = json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))
    assert summary["passed"] and summary["lane"] == lane and summary["samples"] == 3, summary
    assert "reproduced its anchor bit for bit" in summary["verdict"], summary["verdict"]
    assert "did not reproduce" not in summary["verdict"], summary["verdict"]
