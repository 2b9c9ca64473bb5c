"""The connector lane: a qualification (or calibration) whose handoffs go through the operator's
KV connector between two vLLM engines, judged like any lane.

Same seven steps as :class:`~qualify.run.qualification.QualificationRun`; what differs is where the
KV comes from. "producer ready" starts two resident engines (:mod:`qualify.engines.connector_session`):
a producer (``kv_producer``) and a consumer (``kv_consumer``), both wrapped by the observing
connector. Each handoff, driven as a disaggregated-prefill proxy drives a pair: the producer
prefills the prompt (its request carrying ``kv_transfer_params {"do_remote_decode": true, ...}``)
and its connector saves the KV or keeps it for the consumer; the ``kv_transfer_params`` the
producer's request returns (none for ExampleConnector; for NIXL, where to pull the KV) go with the
consumer's request, while the producer stays up; the consumer's connector loads what it claims
and the consumer decodes the output tokens with every raw logit row; its cold local recompute is
the same engine with the connector's hit suppressed. The
harness reads both branches' tokens, logits and KV and builds the sample record from them as for
any lane, so the judge, the anchors and the receipt are the ones every lane uses. A divergence is
also localised per (layer, K or V, KV head, block) in ``evidence/connector-sample-<n>.json``.

The lane's identity pins the connector (``connector``: its name and the digest of the resolved
connector: module, class, package and version, config digest). A config string may hold
``{storage}``: the run gives it a fresh folder of its own, emptied before each handoff, so no
handoff can load an earlier one's KV.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qualify.contract.lanes import VLLM_BLOCK_SIZE, VLLM_VIA_CONNECTOR_LANE, LaneSpec
from qualify.core import assets
from qualify.core.digests import canonical_sha256, jcs_sha256
from qualify.core.errors import ProducerFailed, Refused, one_line
from qualify.engines.base import DecodeResult, LaneEngine
from qualify.engines.connector_under_test import ConnectorSpec
from qualify.evidence.compare import compare_branches, transform_between
from qualify.evidence.records import failed_sample_record
from qualify.evidence.sample import sample_record
from qualify.evidence.series import sample_series
from qualify.run.qualification import QualificationRun, RunOptions
from qualify.run.run_contract import comparison_bounds, connector_identity_path

STORAGE_PLACEHOLDER = "{storage}"
CONNECTOR_EVIDENCE = "connector"
"""The receipt evidence naming the connector a run went through (``evidence/connector.json``)."""


@dataclass(frozen=True)
class ConnectorRequest:
    """The connector as the operator named it (``--connector``, ``--connector-config``,
    ``--connector-module``, ``--connector-fault``): resolved by the run's first step, so a bad one
    is refused with a receipt."""

    name: str
    config: str | None = None
    module: str | None = None
    fault: str | None = None

    def arguments(self) -> list[str]:
        """The connector's command-line options (a fault is never part of what is frozen)."""
        given = [("--connector-config", self.config), ("--connector-module", self.module)]
        return ["--connector", self.name, *(item for option, value in given if value is not None for item in (option, value))]

    def resolve(self) -> ConnectorChoice:
        """The connector resolved and pinned (vLLM imported, no engine started); one-line ``Refused``."""
        from qualify.engines.connector_under_test import parse_connector_config, resolve_connector

        config = parse_connector_config(self.config, "--connector-config")
        try:
            import vllm  # noqa: F401  (only to refuse its absence in one line)
        except ImportError as exc:
            raise Refused(f"--connector {self.name}: vLLM does not import here ({one_line(str(exc))}); "
                          f"install it with tools/install_vllm.sh") from None
        from qualify.engines.connector_faults import FAULTS  # imports vLLM

        if self.fault is not None and self.fault not in FAULTS:
            raise Refused(f"--connector-fault: found {self.fault!r}, expected one of {', '.join(FAULTS)}")
        return ConnectorChoice(resolve_connector(self.name, module=self.module, config=config), self.fault)


@dataclass(frozen=True)
class ConnectorChoice:
    """The connector an operator named, resolved once at the edge, and an optional fault of the
    fault-injecting wrapper (:data:`qualify.engines.connector_faults.FAULTS`) on every load."""

    spec: ConnectorSpec
    fault: str | None = None

    @property
    def pin(self) -> tuple[str, str]:
        """What the identity pins of this connector: its name and the digest of what resolved it
        (the config by its digest, as written)."""
        pinned = {key: value for key, value in self.spec.as_dict().items() if key != "config"}
        return self.spec.name, jcs_sha256(pinned)


def expand_storage(value: Any, storage: Path) -> Any:
    """``value`` (a config) with every ``{storage}`` in its strings replaced by ``storage``."""
    if isinstance(value, str):
        return value.replace(STORAGE_PLACEHOLDER, str(storage))
    if isinstance(value, dict):
        return {key: expand_storage(item, storage) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_storage(item, storage) for item in value]
    return value


def runtime_spec(choice: ConnectorChoice, storage: Path) -> ConnectorSpec:
    """The connector the engines are started with: ``{storage}`` replaced, and wrapped by the
    fault-injecting connector when the run injects a fault."""
    from qualify.engines.connector_under_test import resolve_connector

    spec = choice.spec
    config = expand_storage(spec.config, storage)
    resolved = resolve_connector(spec.name, module=spec.module_path, config=config)
    if choice.fault is None:
        return resolved
    return resolve_connector("FaultInjectingConnector", module="qualify.engines.connector_faults",
                             config={"connector_under_test": resolved.as_dict(), "fault": None})


class ConnectorFacts:
    """The consumer's facts (name, version, ABI, units, geometry) without starting vLLM in this
    process: the consumer engine runs in its own process."""

    name = "vllm"
    logit_units = "raw"
    known_answer_in_engine_process = True
    """Its known-answer digest is measured by its engine process when it starts (``qualify.engines.kat``)."""

    def __init__(self, model_dir: Path) -> None:
        from qualify.engines.checkpoint import load_config
        from qualify.engines.vllm_engine import check_pin, vllm_engine_abi

        self.version = check_pin()
        self.abi = vllm_engine_abi()
        self.geometry = load_config(model_dir).geometry

    def _elsewhere(self, *_: Any) -> Any:
        raise RuntimeError("the connector lane's consumer runs in its engine process, not here")

    prefill = decode = teacher_forced = _elsewhere


class ConnectorLaneRun(QualificationRun):
    """A run whose handoffs go through the operator's connector (see the module docstring)."""

    def __init__(self, options: RunOptions, contract: Any = None, log: Any = None, *,
                 request: ConnectorRequest, **kwargs: Any) -> None:
        super().__init__(options, contract, log, **kwargs)
        self.request = request
        self._choice: ConnectorChoice | None = None
        self._work = Path(tempfile.mkdtemp(prefix="qualify-connector-"))
        self._storage = self._work / "storage"
        self._model_view: Path | None = None
        self._sessions: dict[str, Any] = {}
        self._cold: dict[str, Any] | None = None
        self._cold_prompt: np.ndarray | None = None

    @property
    def choice(self) -> ConnectorChoice:
        return self._have(self._choice, "resolved connector")

    def _seal_identity(self) -> str:
        try:
            self._choice = self.request.resolve()
        except Refused as refusal:
            raise self._refused_with_receipt(refusal, None, None) from None
        return super()._seal_identity()

    def _chosen_lane_name(self) -> str | None:
        return VLLM_VIA_CONNECTOR_LANE

    # -- what the identity must be -------------------------------------------------------------

    def connector_pin(self) -> tuple[str, str] | None:
        return self.choice.pin

    def build_consumer(self, spec: LaneSpec) -> LaneEngine:
        # The consumer engine runs in its own process; here only its facts (after --model is chosen).
        return self._given_consumer or _consumer_facts()

    def default_identity_path(self) -> Path:
        return connector_identity_path(self.choice.spec.name)

    # -- the engines -------------------------------------------------------------------------

    def _start_producer(self) -> str:
        from qualify.engines.connector_session import EngineSession

        self._stop_sessions()
        shutil.rmtree(self._storage, ignore_errors=True)
        self._storage.mkdir(parents=True)
        spec = runtime_spec(self.choice, self._storage)
        model_dir = _model_dir()
        receipt = self._receipt
        evidence = {"schema": "trust-ladder.connector.v1", "connector": self.choice.spec.as_dict(),
                    "pin": {"name": self.choice.pin[0], "sha256": self.choice.pin[1]}, "fault": self.choice.fault}
        try:
            for role in ("serve-consumer", "serve-producer"):
                env = self.producer_env if role == "serve-producer" else {}
                self._sessions[role] = EngineSession(role, spec, model_dir, self._work / role, env=dict(env),
                                                     model_view=self._shared_model_view(model_dir))
        except RuntimeError as exc:
            self._stop_sessions()
            receipt.add_evidence(CONNECTOR_EVIDENCE, evidence)
            raise Refused(f"connector {self.choice.spec.name}: cannot run here: {one_line(str(exc))}") from None
        # Each engine process measured its known-answer digest when it started: recorded with the
        # connector (a freeze pins them from there), then checked against a sealed identity's pins.
        known_answers = {role.removeprefix("serve-"): self._sessions[role].ready.get("kat_sha256")
                         for role in ("serve-producer", "serve-consumer")}
        measured = all(isinstance(digest, str) for digest in known_answers.values())
        receipt.add_evidence(CONNECTOR_EVIDENCE, {**evidence, **({"kat": known_answers} if measured else {})})
        ready = self._sessions["serve-producer"].ready
        receipt.set_producer_host(ready.get("host_facts"), problem=None if "host_facts" in ready else "not reported")
        consumer_abi = self._sessions["serve-consumer"].ready["engine_abi"]
        if ready["engine_abi"] != self._consumer.abi or consumer_abi != self._consumer.abi:
            raise Refused(f"connector engines: ABIs {ready['engine_abi']} and {consumer_abi}, this host's vLLM "
                          f"is {self._consumer.abi}")
        self._check_known_answers(known_answers)
        self.log(f"consumer page layout checked against the reference engine: max abs "
                 f"{self._sessions['serve-consumer'].ready['layout_max_abs']:.3g}")
        self.log(f"connector engines ready: {self.choice.spec.name} ({self.choice.spec.module}.{self.choice.spec.class_name}, "
                 f"{self.choice.spec.package} {self.choice.spec.version}, config sha256 {self.choice.spec.config_sha256}); "
                 f"producer started in {ready['start_s']:.1f} s, fault {self.choice.fault or 'none'}, "
                 f"producer environment overrides {self.producer_env or 'none'}")
        return "connector producer and consumer engines started"

    @property
    def _identity_pins(self) -> dict[str, str | None] | None:
        """The sealed identity's known-answer pins by role (None: a calibration, no identity yet)."""
        from qualify.contract.identity import load_identity

        document = self._contract.identity_document
        if not isinstance(document, Path):
            return None
        identity = load_identity(document)
        return {"producer": identity.producer_engine.kat_sha256, "consumer": identity.consumer_engine.kat_sha256}

    def _check_known_answers(self, found: dict[str, Any]) -> None:
        """Refuse an engine that reported no known-answer digest, or one other than a sealed
        identity's pin (``qualify.engines.kat``)."""
        from qualify.engines.kat import check_known_answer

        pins = self._identity_pins
        for role, digest in found.items():
            if not isinstance(digest, str):
                raise Refused(f"connector {role} engine: reported no known-answer digest")
            if pins is not None:
                check_known_answer(self._consumer, pins[role], role, found=digest)
        if pins is not None:
            self.log(f"known-answer digests: producer {found['producer']}, consumer {found['consumer']}, as pinned")

    def restart_producer(self, env: dict[str, str]) -> None:
        """A calibration's next cell under a fresh producer engine (the consumer stays up)."""
        from qualify.engines.connector_session import EngineSession

        producer = self._sessions.pop("serve-producer", None)
        if producer is not None:
            producer.close()
        self.producer_env = dict(env)
        spec = runtime_spec(self.choice, self._storage)
        try:
            model_dir = _model_dir()
            self._sessions["serve-producer"] = EngineSession("serve-producer", spec, model_dir,
                                                             self._work / "serve-producer", env=dict(env),
                                                             model_view=self._shared_model_view(model_dir))
        except RuntimeError as exc:
            raise ProducerFailed(f"connector producer did not restart: {one_line(str(exc))}") from None
        ready = self._sessions["serve-producer"].ready
        self._receipt.set_producer_host(ready.get("host_facts"), problem=None if "host_facts" in ready else "not reported")
        self.log(f"connector producer restarted, environment overrides {env or 'none'}")

    def _shared_model_view(self, model_dir: Path) -> Path:
        """One folder of the model's files that both engines name the model by, made once per run
        (a NIXL pair's handshake refuses a peer whose model path differs)."""
        if self._model_view is None:
            from qualify.engines.checkpoint import model_files_view

            self._model_view = model_files_view(model_dir, "vllm", at=self._work / "model")
        return self._model_view

    def _session(self, role: str) -> Any:
        return self._have(self._sessions.get(role), f"connector {role} engine")

    def _prompt_file(self) -> Path:
        path = self._work / "prompt.npy"
        np.save(path, np.asarray(self._contract.prompt, dtype=np.int64))
        return path

    def _compute_reference(self) -> str:
        contract = self._contract
        out = self._work / "cold.npz"
        started = time.perf_counter()
        try:
            self._session("serve-consumer").request({
                "op": "cold", "key": f"cold-{len(self.records) + 1}", "prompt": str(self._prompt_file()),
                "tokens": contract.output_tokens, "out": str(out)})
        except RuntimeError as exc:
            raise ProducerFailed(f"connector consumer: cold recompute failed: {one_line(str(exc))}") from None
        seconds = time.perf_counter() - started
        self.seconds["recompute"] = self.seconds.get("recompute", 0.0) + seconds
        with np.load(out, allow_pickle=False) as arrays:
            self._cold = {key: arrays[key] for key in arrays.files}
        self._cold_prompt = np.asarray(contract.prompt).copy()
        return f"cold local recompute (connector hit suppressed): {contract.output_tokens} tokens in {seconds:.2f} s"

    def _handoff(self, index: int) -> str:
        contract = self._contract
        repetition = index + 1
        key = f"sample-{repetition}"
        if self._cold is None or self._cold_prompt is None or not np.array_equal(self._cold_prompt, contract.prompt):
            self._compute_reference()
        cold = self._cold
        assert cold is not None  # computed just above
        # Every handoff starts from empty storage: nothing an earlier handoff saved can be loaded.
        if self._storage.exists():
            shutil.rmtree(self._storage)
        self._storage.mkdir(parents=True)
        prompt_file = self._prompt_file()
        out = self._work / f"{key}.npz"
        from qualify.engines.connector_pair import PREFILL_TRANSFER_PARAMS

        try:
            # As a disaggregated-prefill proxy drives a pair: the producer's request asks its connector
            # to keep the KV for a remote decode; what it returns (none for ExampleConnector, where to
            # pull the KV for NIXL) goes with the consumer's request, the producer still up.
            saved = self._session("serve-producer").request({
                "op": "produce", "key": key, "prompt": str(prompt_file), "transfer": PREFILL_TRANSFER_PARAMS})
            loaded = self._session("serve-consumer").request({
                "op": "load", "key": key, "prompt": str(prompt_file), "tokens": contract.output_tokens,
                "out": str(out), "fault": self.choice.fault, "transfer": saved.get("kv_transfer_params")})
        except (RuntimeError, Refused) as exc:
            return self._keep(failed_sample_record(repetition, f"connector failed: {one_line(str(exc))}"), repetition)
        claimed = int(loaded["claimed_tokens"])
        if claimed == 0:
            return self._keep(failed_sample_record(
                repetition, f"no handoff: the consumer's connector claimed 0 of {len(contract.prompt)} prompt tokens "
                            f"(the producer saved {saved['saved_tokens']})"), repetition)
        with np.load(out, allow_pickle=False) as arrays:
            handoff = {name: arrays[name] for name in arrays.files}
        layers = self._consumer.geometry.layers
        handoff_kv = ([handoff[f"k{i}"] for i in range(layers)], [handoff[f"v{i}"] for i in range(layers)])
        own_kv = ([cold[f"k{i}"][:, :claimed] for i in range(layers)], [cold[f"v{i}"][:, :claimed] for i in range(layers)])
        started = time.perf_counter()
        maximum_absolute, maximum_mean_absolute = comparison_bounds(contract.rule)
        comparison = compare_branches(
            DecodeResult(handoff["tokens"], handoff["logits"]), DecodeResult(cold["tokens"], cold["logits"]),
            transform_between(self._consumer.logit_units, contract.logit_units),
            maximum_absolute=maximum_absolute, maximum_mean_absolute=maximum_mean_absolute,
            handoff_kv=handoff_kv, own_kv=own_kv)
        self._add_seconds("compare", started)
        cells = _cells(handoff_kv, own_kv, claimed)
        from qualify.engines.connector_pair import digest_mismatches, localise

        mismatches = digest_mismatches(loaded["loaded_digests"], saved["saved_digests"])
        self._receipt.add_evidence(f"connector-sample-{repetition}", {
            "schema": "trust-ladder.connector-sample.v1", "claimed_tokens": claimed,
            "saved_tokens": saved["saved_tokens"], "kv_cells": [cell.as_dict() for cell in cells],
            "kv_localisation": localise(cells), "loaded_cells_differing_from_saved": mismatches})
        first = cells[0] if cells else None
        self.log(f"{key}: connector loaded {claimed} of {len(contract.prompt)} prompt tokens; "
                 + ("loaded KV bit-equal to the cold prefill" if first is None else
                    f"loaded KV differs in {len(cells)} cells (layer, K/V, KV head, block), first at layer "
                    f"{first.layer} {first.tensor} head {first.head} block {first.block} position {first.first_position}")
                 + f"; {len(mismatches)} loaded cells differ from what the producer saved")
        payload_bytes = int(sum(array.nbytes for array in (*handoff_kv[0], *handoff_kv[1])))
        load_s = float(loaded["seconds"])
        self._series[repetition] = sample_series(comparison)
        record = sample_record(
            repetition=repetition, comparison=comparison,
            # What the producer handed its connector, per cell: a deterministic producer repeats it.
            payload_sha256=canonical_sha256(saved["saved_digests"]),
            seams_sha256=canonical_sha256(sorted(saved["saved_digests"].items())),
            payload_bytes=payload_bytes, payload_gbit_per_s=payload_bytes * 8 / 1e9 / max(load_s, 1e-9),
            handed_off_positions=claimed, recomputed_positions=len(contract.prompt) - claimed,
            kv_envelope=contract.kv_envelope,
            # The connector's save is inside the producer's prefill and its load inside the consumer's
            # request: there is no separate serialize, transport, verify or install to time.
            phases={"producer_compute_s": float(saved["seconds"]), "serialize_s": 0.0, "transport_s": 0.0,
                    "verify_s": 0.0, "install_s": 0.0, "decode_s": load_s,
                    "recompute_s": self.seconds.get("recompute", 0.0)},
        )
        return self._keep(record, repetition)

    # -- stopping ------------------------------------------------------------------------------

    def _stop_sessions(self, kill: bool = False) -> None:
        for session in self._sessions.values():
            if kill:
                session.kill()
            session.close()
        self._sessions.clear()

    def interrupted(self, signum: int) -> None:
        self._stop_sessions(kill=True)
        super().interrupted(signum)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stop_sessions()
            shutil.rmtree(self._work, ignore_errors=True)


def _cells(handoff_kv: tuple[list[np.ndarray], list[np.ndarray]], own_kv: tuple[list[np.ndarray], list[np.ndarray]],
           positions: int) -> list[Any]:
    from qualify.engines.connector_pair import compare_kv_cells

    ours = {i: (handoff_kv[0][i], handoff_kv[1][i]) for i in range(len(handoff_kv[0]))}
    theirs = {i: (own_kv[0][i], own_kv[1][i]) for i in range(len(own_kv[0]))}
    return compare_kv_cells(ours, theirs, positions, VLLM_BLOCK_SIZE)


def _model_dir() -> Path:
    """The model directory vLLM loads: the shipped model, or the chosen ``--model``'s float32 view."""
    from qualify.core import model_choice

    if model_choice.chosen() is None:
        return assets.MODEL_DIR
    from qualify.engines.chosen_model import hf_float32_dir

    return hf_float32_dir()


def _consumer_facts() -> LaneEngine:
    from qualify.contract.lanes import lane_spec
    from qualify.engines.factory import lane_engine_of

    return lane_engine_of(ConnectorFacts(_model_dir()), lane_spec(VLLM_VIA_CONNECTOR_LANE), "consumer")
