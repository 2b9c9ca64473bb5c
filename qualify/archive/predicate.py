"""What a receipt's signed statement concludes (``contracts/receipt-statement.v1.schema.json``,
``predicate``): status and verdict, lane, identity digest, rule, per-sample numbers, scope and the
hosts, taken from the files it signs, so an auditor reads the conclusion without re-parsing them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qualify import __version__
from qualify.archive.attestation import PREDICATE_SCHEMA

_SAMPLE_FIELDS = ("max_abs", "mean_abs", "token_agreement_rate", "output_tokens",
                  "handoff_generated_token_sha256", "cold_generated_token_sha256", "error")


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def host_summary(facts: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The facts that decide whether a verdict transfers: CPU class, BLAS kernel and threads,
    GPUs, harness commit (the full document is the receipt's host.json)."""
    if facts is None:
        return None
    cpu, blas, gpu, harness = (_mapping(facts.get(name)) for name in ("cpu", "blas", "gpu", "harness"))
    found = gpu.get("devices")
    devices: list[Any] = found if isinstance(found, list) else []
    threads = blas.get("num_threads")
    return {
        "cpu_model": _text(cpu.get("model")),
        "isa_class": _text(cpu.get("isa_class")),
        "machine": _text(facts.get("machine")),
        "blas_library": _text(blas.get("library")),
        "blas_kernel": _text(blas.get("kernel")),
        "blas_threads": threads if type(threads) is int and threads >= 0 else None,
        "gpus": [str(device.get("name") if isinstance(device, Mapping) else device)[:200] for device in devices][:64],
        "harness_commit": _text(harness.get("commit")),
    }


def sample_numbers(sample: Mapping[str, Any]) -> dict[str, Any]:
    """One sample's headline numbers, as its record holds them (non-finite ones as strings)."""
    localisation = sample.get("localisation")
    divergence = localisation.get("first_divergence_position") if isinstance(localisation, Mapping) else None
    numbers = {name: sample.get(name) for name in _SAMPLE_FIELDS}
    numbers = {name: sample.get(name) for name in _SAMPLE_FIELDS}
    return {"repetition": sample["repetition"], "first_divergence_position": divergence, **numbers}


def scope(summary: Mapping[str, Any], consumer: Mapping[str, Any] | None) -> str:
    """What the verdict covers, in words: the lane and identity, the rule, the consumer's host."""
    rule = summary.get("rule") or {}
    lane, recipe, digest = summary.get("lane"), summary.get("recipe"), summary.get("identity_sha256")
    if summary.get("status") == "refused":
        which = f"lane {lane}" if lane else "a lane whose identity did not load"
        return f"nothing was judged: the run of {which} ({recipe}) was refused before any handoff"
    if rule.get("rung") == 3:
        measure = "greedy tokens and every full logit row bit-identical to the cold recompute"
    elif rule.get("rung") == 2:
        measure = (f"greedy tokens exact and full-logit drift within max |Δlogit| <= {rule.get('maximum_absolute')}, "
                   f"mean <= {rule.get('maximum_mean_absolute')}")
    else:
        measure = "no judging rule was reached"
    repetitions, tokens = rule.get("repetitions"), rule.get("output_tokens")
    where = "an unrecorded consumer host"
    if consumer is not None:
        where = (f"a consumer on {consumer['machine']} {consumer['isa_class']} "
                 f"({consumer['blas_library']} {consumer['blas_kernel']}, {consumer['blas_threads']} threads)")
    return (f"lane {lane} ({recipe}) under identity {digest}: {measure}, over {repetitions} ordered handoffs of "
            f"{tokens} greedy tokens each, {summary.get('samples')} recorded; on {where}; this lane and identity only")


def receipt_predicate(summary: Mapping[str, Any], samples: Sequence[Mapping[str, Any]],
                      host: Mapping[str, Any]) -> dict[str, Any]:
    """The predicate of a receipt from its summary, sample records and host document."""
    consumer = host_summary(host.get("consumer"))
    return {
        "schema": PREDICATE_SCHEMA,
        "run_id": summary["run_id"],
        "status": summary["status"],
        "verdict": summary["verdict"],
        "reasons": list(summary["reasons"]),
        "error": summary.get("error"),
        "recipe": summary.get("recipe"),
        "lane": summary.get("lane"),
        "rung": summary.get("rung"),
        "identity_sha256": summary.get("identity_sha256"),
        "rule": summary.get("rule"),
        "samples": [sample_numbers(sample) for sample in samples],
        "scope": scope(summary, consumer),
        "host": {"consumer": consumer,
                 "producers": [host_summary(start.get("facts")) for start in host.get("producers", [])]},
        "started_utc": summary["started_utc"],
        "finished_utc": summary["finished_utc"],
        "harness_version": __version__,
    }
