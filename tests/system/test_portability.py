"""The embedded engines' judged outputs do not depend on the machine's BLAS kernel, BLAS thread count
or numpy's SIMD dispatch (``qualify.core.numerics`` makes them exact by construction).

A matrix of child processes, each in its own environment:

* ``OPENBLAS_CORETYPE``: every OpenBLAS kernel set of the pinned numpy's DYNAMIC_ARCH OpenBLAS
  that this CPU can run, out of SkylakeX (AVX-512), Haswell (AVX2 + FMA), Sandybridge (AVX) and
  Prescott (SSE3; OpenBLAS names it Katmai). Zen is not a separate entry: this OpenBLAS build runs
  the Haswell kernels for it (``get_corename`` says Haswell);
* ``OPENBLAS_NUM_THREADS`` 1 and 2;
* numpy's SIMD dispatch as detected, and with its widest family switched off
  (``NPY_DISABLE_CPU_FEATURES``): every AVX-512 dispatch target numpy reports on this CPU, or on
  a CPU without AVX-512, AVX2 and FMA3. The list comes from numpy's own ``__cpu_dispatch__`` and
  ``__cpu_features__``: numpy 2.3 raises on a baseline feature, prints a warning for a name
  outside its dispatch list and silently accepts a dispatch target the CPU lacks, so a hard-coded
  AVX-512 list on a CPU without AVX-512 would disable nothing and the axis would run one dispatch
  twice. The children also report the SIMD target numpy's ufuncs dispatched to, and the test
  requires the two settings to differ there.

Each child runs a short prefill + decode on every embedded engine and prints one digest set per
engine (KV with any draft context, tokens, every logit row, draft trace), together with the
environment it really ran in (OpenBLAS core name and thread count, numpy's enabled features and
the SIMD target its ufuncs dispatched to). The test fails when a child did not get its
environment (a matrix that silently ran one environment twelve times proves nothing) and when
any two environments disagree on one bit. A second leg runs one full rung-3 calibration (2047
positions handed off, 256-token speculative decode) through the CLI under three environments of
the matrix and compares the receipts' deterministic digests.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.core import assets
from qualify.core.hostenv import cpu_flags
from tests.support.receipt_forgery import check

pytestmark = pytest.mark.slow

# Variables this test sets per child; inherited values are dropped so they cannot leak in.
CONTROLLED = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OPENBLAS_VERBOSE", "GOTO_NUM_THREADS",
              "OMP_NUM_THREADS", "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES")

# (OPENBLAS_CORETYPE, /proc/cpuinfo flags it needs, the core name OpenBLAS then reports). The
# pinned scipy-openblas 0.3.30 aliases Prescott's kernel set to the name Katmai.
KERNELS = (
    ("SkylakeX", frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}), "SkylakeX"),
    ("Haswell", frozenset({"avx2", "fma"}), "Haswell"),
    ("Sandybridge", frozenset({"avx"}), "Sandybridge"),
    ("Prescott", frozenset(), "Katmai"),
)
THREADS = (1, 2)
DISPATCHES = ("default", "reduced")
WORKERS = 2  # children at once (a 2-core CI machine)
CHILD_TIMEOUT_S = 600

# What a child reports about the environment it runs in (source shared by both child scripts).
ENVIRONMENT_FACTS = r'''
def environment_facts():
    import ctypes, glob, os
    import numpy as np
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    from numpy.lib.introspect import opt_func_info
    try:
        from threadpoolctl import threadpool_info
        blas = [pool for pool in threadpool_info() if pool.get("internal_api") == "openblas"]
        corename, threads = blas[0]["architecture"], blas[0]["num_threads"]
    except ImportError:
        found = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs",
                                       "libscipy_openblas64_*.so"))
        lib = ctypes.CDLL(found[0])
        lib.scipy_openblas_get_corename64_.restype = ctypes.c_char_p
        lib.scipy_openblas_get_num_threads64_.restype = ctypes.c_int
        corename = lib.scipy_openblas_get_corename64_().decode()
        threads = lib.scipy_openblas_get_num_threads64_()
    ufuncs = opt_func_info(func_name="^(add|multiply|divide|maximum|minimum|sqrt|rint|ldexp)$",
                           signature="^(float32|float64)")
    return {"openblas_corename": corename, "openblas_threads": int(threads),
            "numpy_features": sorted(name for name, on in __cpu_features__.items() if on),
            "numpy_dispatch": list(__cpu_dispatch__),
            "ufunc_targets": {f"{name}.{sig}": info["current"]
                              for name, sigs in sorted(ufuncs.items()) for sig, info in sorted(sigs.items())}}
'''

# Every embedded engine: a 300-token prompt (299 prefilled, the last one pending, as the recipes
# split 2047 + 1) and 16 greedy decode steps; plus the default rung-2 handoff (the exact consumer
# decoding the w4a4 producer's KV). The speculative engine's KV carries its draft context.
MATRIX_CHILD = ENVIRONMENT_FACTS + r'''
import dataclasses, hashlib, json
import numpy as np
from qualify.core import assets
from qualify.engines.checkpoint import load_config, load_weights
from qualify.contract.lanes import lane_spec
from qualify.engines.factory import build_consumer, build_producer
from qualify.engines.reference import ReferenceEngine

PREFILLED, STEPS = 299, 16
prompt = assets.load_prompt()
config = load_config(assets.MODEL_DIR)
# The shipped weights under another RoPE base (SmolLM2's): numpy's float32 power gave other
# inverse frequencies there with AVX-512 than without, which the shipped base 10000 hid.
rope_100000 = dataclasses.replace(config.geometry, rope_theta=100000.0)
engines = {
    "reference": ReferenceEngine.from_model_dir(),
    "reference@rope-theta-100000": ReferenceEngine(rope_100000, load_weights(assets.MODEL_DIR, config),
                                                   rms_norm_eps=config.rms_norm_eps),
    "nvfp4-native-w4a4:producer": build_producer("nvfp4-native-w4a4", "native"),
    "nvfp4-native-splitk:producer": build_producer("nvfp4-native-splitk", "native"),
    "nvfp4-native-f16:producer": build_producer("nvfp4-native-f16", "native"),
    "nvfp4:consumer": build_consumer(lane_spec("nvfp4-native-w4a4")),
    "kquant-native:producer": build_producer("kquant-native", "native"),
    "kquant-exact-dflash": build_consumer(lane_spec("kquant-exact-dflash")),
}

def sha(*chunks):
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()

def kv_digest(kv):
    return sha(*(part for name, array in kv.tensors().items()
                 for part in (name.encode(), np.ascontiguousarray(array).tobytes())))

def decode_digests(result):
    assert result.tokens.shape == (STEPS,) and result.logits.shape[0] == STEPS
    return {"tokens": sha(result.tokens.astype("<i4").tobytes()),
            "logits": sha(np.ascontiguousarray(result.logits, dtype="<f4").tobytes()),
            "draft_trace": None if result.draft_trace is None else sha(json.dumps(result.draft_trace).encode())}

digests, kvs = {}, {}
for name, engine in engines.items():
    kvs[name] = kv = engine.prefill(prompt[:PREFILLED])
    digests[name] = {"kv": kv_digest(kv), **decode_digests(engine.decode(kv, prompt[PREFILLED:PREFILLED + 1], STEPS))}
assert kvs["kquant-exact-dflash"].draft is not None and digests["kquant-exact-dflash"]["draft_trace"]
handoff = engines["nvfp4:consumer"].decode(kvs["nvfp4-native-w4a4:producer"], prompt[PREFILLED:PREFILLED + 1], STEPS)
digests["nvfp4-native-w4a4->consumer"] = decode_digests(handoff)
print(json.dumps({"environment": environment_facts(), "digests": digests}))
'''

# The CLI's own entry point, after recording the environment it runs in (argv: facts path, CLI args).
CLI_CHILD = ENVIRONMENT_FACTS + r'''
import json, sys
with open(sys.argv[1], "w", encoding="utf-8") as facts:
    json.dump(environment_facts(), facts)
from qualify.interfaces.cli import main
sys.exit(main(sys.argv[2:]))
'''


@dataclass(frozen=True)
class Environment:
    kernel: str
    threads: int
    dispatch: str  # "default" | "reduced"

    @property
    def label(self) -> str:
        return f"{self.kernel}/threads={self.threads}/{self.dispatch}"


@dataclass(frozen=True)
class Host:
    kernels: tuple[tuple[str, str], ...]  # (OPENBLAS_CORETYPE, expected core name)
    reduced: tuple[str, ...]  # NPY_DISABLE_CPU_FEATURES for the "reduced" dispatch

    def variables(self, environment: Environment) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in CONTROLLED}
        env.update(OPENBLAS_CORETYPE=environment.kernel, OPENBLAS_NUM_THREADS=str(environment.threads),
                   OMP_NUM_THREADS=str(environment.threads), PYTHONPATH=str(assets.REPO_ROOT))
        if environment.dispatch == "reduced":
            env["NPY_DISABLE_CPU_FEATURES"] = ",".join(self.reduced)
        return env

    def matrix(self) -> list[Environment]:
        return [Environment(kernel, threads, dispatch)
                for kernel, _ in self.kernels for threads in THREADS for dispatch in DISPATCHES]


@pytest.fixture(scope="module")
def host() -> Host:
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("the portability scope is x86-64 CPUs with AVX2; this machine is "
                    f"{platform.machine()}{'' if 'avx2' in cpu_flags() else ' without AVX2'}")
    env = {key: value for key, value in os.environ.items() if key not in CONTROLLED}
    script = ENVIRONMENT_FACTS + "import json\nprint(json.dumps(environment_facts()))"
    probe = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    assert probe.returncode == 0, probe.stderr[-2000:]
    facts = json.loads(probe.stdout.strip().splitlines()[-1])
    enabled, dispatch = set(facts["numpy_features"]), facts["numpy_dispatch"]
    reduced = tuple(name for name in dispatch if name.startswith("AVX512") and name in enabled)
    if not reduced:  # no AVX-512 here: numpy's next-widest dispatch family
        reduced = tuple(name for name in ("AVX2", "FMA3") if name in dispatch and name in enabled)
    assert reduced, f"numpy dispatches to none of AVX-512, AVX2, FMA3 here: {dispatch}, enabled {sorted(enabled)}"
    kernels = tuple((kernel, corename) for kernel, needs, corename in KERNELS if needs <= cpu_flags())
    assert len(kernels) >= 3, f"fewer than 3 OpenBLAS kernels runnable on this CPU: {kernels}"
    return Host(kernels, reduced)


def run_children(commands: list[tuple[Environment, list[str]]], host: Host) -> list[subprocess.CompletedProcess]:
    def run(item: tuple[Environment, list[str]]) -> subprocess.CompletedProcess:
        environment, argv = item
        return subprocess.run(argv, env=host.variables(environment), cwd=assets.REPO_ROOT,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(run, commands))


def check_environment(environment: Environment, facts: dict, host: Host, where: str = "child") -> None:
    """The process ran in the environment it was given: kernel, thread count, SIMD dispatch."""
    label = f"{environment.label} ({where})"
    expected_core = dict(host.kernels)[environment.kernel]
    assert facts["openblas_corename"].lower() == expected_core.lower(), \
        f"{label}: OpenBLAS runs {facts['openblas_corename']}, expected {expected_core}"
    assert facts["openblas_threads"] == environment.threads, \
        f"{label}: OpenBLAS runs {facts['openblas_threads']} threads"
    enabled = set(facts["numpy_features"]) & set(host.reduced)
    if environment.dispatch == "reduced":
        assert not enabled, f"{label}: numpy still enables {sorted(enabled)}"
    else:
        assert enabled == set(host.reduced), f"{label}: numpy lacks {sorted(set(host.reduced) - enabled)}"


def check_environments_differ(seen: dict[Environment, dict], host: Host) -> None:
    """Every kernel ran under its own core name, and the two dispatch settings really dispatched
    numpy's ufuncs to different SIMD targets."""
    cores = {environment.kernel: facts["openblas_corename"] for environment, facts in seen.items()}
    assert len(set(cores.values())) == len(host.kernels) >= 3, f"kernels that ran: {cores}"
    targets = {dispatch: {json.dumps(facts["ufunc_targets"], sort_keys=True)
                          for environment, facts in seen.items() if environment.dispatch == dispatch}
               for dispatch in {environment.dispatch for environment in seen}}
    if len(targets) > 1:
        assert all(len(found) == 1 for found in targets.values()), targets
        assert targets["default"] != targets["reduced"], \
            f"NPY_DISABLE_CPU_FEATURES={','.join(host.reduced)} moved no ufunc to another SIMD target"


def test_engines_are_bit_identical_across_blas_kernels_threads_and_simd_dispatch(host: Host) -> None:
    matrix = host.matrix()
    assert len(matrix) == len(host.kernels) * len(THREADS) * len(DISPATCHES) >= 12
    completed = run_children([(environment, [sys.executable, "-c", MATRIX_CHILD]) for environment in matrix], host)
    outputs: dict[Environment, dict] = {}
    for environment, child in zip(matrix, completed, strict=True):
        assert child.returncode == 0, f"{environment.label}: exit {child.returncode}\n{child.stderr[-3000:]}"
        outputs[environment] = json.loads(child.stdout.strip().splitlines()[-1])
        check_environment(environment, outputs[environment]["environment"], host)
    check_environments_differ({environment: output["environment"] for environment, output in outputs.items()}, host)

    first, baseline = matrix[0], outputs[matrix[0]]["digests"]
    assert len(baseline) == 9 and all(baseline.values())
    differing = {f"{environment.label}: {engine}.{part}"
                 for environment in matrix[1:] for engine, parts in baseline.items()
                 for part, digest in parts.items()
                 if outputs[environment]["digests"].get(engine, {}).get(part) != digest}
    assert not differing, f"digests differ from {first.label}: {sorted(differing)}"
    # The native producers really differ from the consumer, and the other RoPE base from the
    # shipped one (else this compared one engine 8 times).
    assert len({parts["kv"] for engine, parts in baseline.items() if "kv" in parts}) == 8


# Per-sample fields that must be bit-identical wherever the calibration runs (timings excluded).
SAMPLE_DIGEST_FIELDS = (
    "payload_sha256", "seams_sha256",
    "handoff_logit_block_sha256", "cold_logit_block_sha256",
    "handoff_logit_row_sha256", "cold_logit_row_sha256",
    "handoff_generated_token_sha256", "cold_generated_token_sha256",
    "handoff_draft_tokens_sha256", "cold_draft_tokens_sha256",
    "handoff_draft_trace_sha256", "cold_draft_trace_sha256",
    "draft_acceptance_rate", "max_abs", "mean_abs", "token_agreement_rate", "output_tokens",
    "handed_off_positions",
)


def check_receipt_host(environment: Environment, receipts: Path, host: Host) -> None:
    """The receipt's host facts (``host.json``) say the consumer and the producer process (the
    handoff service the calibration starts) both ran in the child's environment."""
    documents = sorted(receipts.glob("*/host.json"))
    assert len(documents) == 1, f"{environment.label}: host.json files {documents}"
    checked = check(documents[0].parent)  # signed by the operator's key, every file as signed
    assert (checked.state, checked.status) == ("verified", "passed"), f"{environment.label}: {checked}"
    document = json.loads(documents[0].read_text(encoding="utf-8"))
    processes = {"consumer": document["consumer"],
                 **{f"producer {n}": p["facts"] for n, p in enumerate(document["producers"], 1)}}
    assert len(processes) >= 2, f"{environment.label}: no producer in host.json"
    for role, facts in processes.items():
        check_environment(environment, {
            "openblas_corename": facts["blas"]["kernel"], "openblas_threads": facts["blas"]["num_threads"],
            "numpy_features": facts["numpy"]["simd_dispatch_enabled"]}, host, f"host.json {role}")


def test_full_rung3_calibration_is_bit_identical_across_environments(host: Host, tmp_path: Path) -> None:
    """``qualify --recipe kquant-target-plus-dflash`` (2047 positions + draft context handed off,
    256 speculative decode steps, one cold recompute; the producer runs in the operator's
    environment, which a qualification never varies) under three environments, checked
    in the CLI process and in the receipt's host facts of both processes: three kernels, both
    thread counts and both dispatch settings appear among them. Two BLAS threads go with the
    fastest kernel: the oldest one (Prescott) on two threads next to another child on two cores
    spends most of its time in OpenBLAS's spin-waits (speed only; the short leg covers it)."""
    kernels = [kernel for kernel, _ in host.kernels]
    chosen = [Environment(kernels[0], 2, "reduced"), Environment(kernels[1], 1, "default"),
              Environment(kernels[-1], 1, "reduced")]
    commands = []
    ensure_signing_key()  # made once here, not raced for by three first runs at once
    for index, environment in enumerate(chosen):
        facts, receipts = tmp_path / f"facts-{index}.json", tmp_path / f"receipts-{index}"
        commands.append((environment, [sys.executable, "-c", CLI_CHILD, str(facts),
                                       "--recipe", "kquant-target-plus-dflash", "--reference-once",
                                       "--receipts", str(receipts)]))
    completed = run_children(commands, host)
    records, seen = {}, {}
    for index, (environment, child) in enumerate(zip(chosen, completed, strict=True)):
        assert child.returncode == 0, f"{environment.label}: exit {child.returncode}\n" \
                                      f"{child.stdout[-2000:]}\n{child.stderr[-2000:]}"
        seen[environment] = json.loads((tmp_path / f"facts-{index}.json").read_text(encoding="utf-8"))
        check_environment(environment, seen[environment], host)
        check_receipt_host(environment, tmp_path / f"receipts-{index}", host)
        samples = sorted((tmp_path / f"receipts-{index}").glob("*/samples/*.json"))
        assert len(samples) == 3, f"{environment.label}: sample records {samples}"
        record = json.loads(samples[0].read_text(encoding="utf-8"))
        assert record["error"] is None and record["logit_row_digests_equal"] is True, environment.label
        missing = [name for name in SAMPLE_DIGEST_FIELDS if record.get(name) is None]
        assert not missing, f"{environment.label}: sample record lacks {missing}"
        records[environment] = {name: record[name] for name in SAMPLE_DIGEST_FIELDS}
    assert len({facts["openblas_corename"] for facts in seen.values()}) == 3
    baseline = records[chosen[0]]
    assert baseline["handoff_logit_block_sha256"] == baseline["cold_logit_block_sha256"]
    assert baseline["handoff_draft_trace_sha256"] == baseline["cold_draft_trace_sha256"]
    for environment in chosen[1:]:
        differing = [name for name in SAMPLE_DIGEST_FIELDS if records[environment][name] != baseline[name]]
        assert not differing, f"{environment.label} differs from {chosen[0].label} in {differing}"
