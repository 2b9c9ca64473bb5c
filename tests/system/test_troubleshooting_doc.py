"""docs/troubleshooting.md quotes what the harness really prints: every line the page marks with
``<!-- message: KEY -->`` is reproduced here by running the harness into that situation in a
scratch checkout, and must equal a line of the real output once the parts that differ from run to
run (run ids, digests, absolute paths, numbers, the step a signal landed in) are masked alike.

Not reproduced here, and so not marked in the page: another numpy or CPU class (needs another
environment), a stalled producer (a full run; tests/unit/handoff/test_producer_deadlines.py), a read-only mount,
a non-deterministic identity's envelope seal (a calibration first; tests/system/test_non_deterministic_lane.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from qualify.archive.layout import MANIFEST_SCHEMA
from qualify.core.digests import jcs_bytes
from tests.support.processes import with_default_signals
from tests.system.test_onboarding_doc import REPO, masked, scratch_checkout, scratch_environment

DOC = REPO / "docs" / "troubleshooting.md"
MARKED = re.compile(r"^<!-- message: ([a-z0-9-]+) -->\n```text\n(.*?)\n```", re.MULTILINE)
SPLITK_IDENTITY = "contracts/nvfp4-native-splitk-identity-v1.json"
_SPLITK = json.loads((REPO / SPLITK_IDENTITY).read_text(encoding="utf-8"))["onboarding_qualification"]
SPLITK_BASIS = _SPLITK["basis"].removeprefix("receipt://").partition("/")[0]
"""The shipped splitk identity's basis receipt (signed, with its calibration evidence)."""
SPLITK_BOUNDS = ["--maximum-absolute", repr(_SPLITK["full_logits"]["maximum_absolute"]),
                 "--maximum-mean-absolute", repr(_SPLITK["full_logits"]["maximum_mean_absolute"])]
"""The identity's sealed bounds: what the freeze re-derives from its basis, so only "exists" is left to refuse."""
LEGACY_RECEIPT = "20261130T140940Z-cbd1eb64e4c79106"
"""A committed receipt from before signing (the splitk lane's retired basis): unsigned."""
UNCOPIED_RUN = "20261201T001443Z-2365088d12ed757d"
COMMAND_LIMIT_S = 300
"""A bound on any one command here (each takes seconds)."""


def documented() -> dict[str, str]:
    """KEY -> the line the page quotes under ``<!-- message: KEY -->``."""
    return dict(MARKED.findall(DOC.read_text(encoding="utf-8")))


@dataclass
class Bench:
    """A scratch checkout, its environment, and what the cases share: the operator's trust file
    (``out/trust.json``), another operator's (``out/other-trust.json``) and a receipt signed by the
    operator's key (a run refused after its identity loaded: it names the w4a4 identity)."""

    checkout: Path
    env: dict[str, str]
    home: Path
    signed_receipt: Path

    def run(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=self.checkout, env=env or self.env, capture_output=True, text=True,
                              timeout=COMMAND_LIMIT_S)

    def other_config(self, name: str) -> dict[str, str]:
        """The environment with a config home of its own (no key, no trust file yet)."""
        return {**self.env, "XDG_CONFIG_HOME": str(self.home / name)}


def make_bench(home: Path, checkout_at: Path) -> Bench:
    """A scratch checkout at ``checkout_at`` with config and data homes under ``home``, two trust
    files and a signed receipt."""
    checkout = scratch_checkout(checkout_at)
    env = scratch_environment(checkout, home)
    made = Bench(checkout, env, home, checkout)
    (checkout / "out").mkdir()
    for config, trust in ((env, "out/trust.json"), (made.other_config("other"), "out/other-trust.json")):
        assert made.run("qualify", "keys", "init", env=config).returncode == 0
        shown = made.run("qualify", "keys", "show", "--trust-file", env=config)
        assert shown.returncode == 0, shown.stderr
        (checkout / trust).write_text(shown.stdout, encoding="utf-8")
    refused = made.run("qualify", "--recipe", "kquant-target-plus-dflash", "--identity",
                       "contracts/nvfp4-native-w4a4-identity-v1.json", "--receipts", "out/refused")
    assert refused.returncode == 2, refused.stderr
    (made.signed_receipt,) = (checkout / "out" / "refused").iterdir()
    return made


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Bench:
    home = tmp_path_factory.mktemp("troubleshooting")
    return make_bench(home, home / "checkout")


def writable(path: Path) -> Path:
    """Committed and finalized receipt files are read-only: make one writable to edit it."""
    path.chmod(path.stat().st_mode | 0o200)
    return path


@pytest.fixture
def fresh(tmp_path: Path, bench: Bench) -> Bench:
    """A checkout of its own, for a case that damages a basis receipt."""
    checkout = scratch_checkout(tmp_path / "checkout")
    return Bench(checkout, scratch_environment(checkout, bench.home), bench.home, bench.signed_receipt)


def _vllm_missing(bench: Bench) -> str:
    if find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: --producer vllm would run it")
    return bench.run("qualify", "--recipe", "native-text", "--producer", "vllm", "--receipts", "out/vllm").stderr


def _torch_missing(bench: Bench) -> str:
    """torch made unimportable the way an absent package is (a ``torch`` that raises
    ModuleNotFoundError first on the path): the harness's own refusal is what is checked."""
    shadow = bench.home / "no-torch" / "torch"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**bench.env, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{bench.env['PYTHONPATH']}"}
    return bench.run("qualify", "--recipe", "native-text", "--identity",
                     "contracts/transformers-cuda-fp32-identity-v1.json", "--receipts", "out/torch", env=env).stderr


def _no_cuda(bench: Bench) -> str:
    if find_spec("torch") is None:
        pytest.skip("torch is not installed here: the lane is refused for the missing extra first")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present here")
    return bench.run("qualify", "--recipe", "native-text", "--identity",
                     "contracts/transformers-cuda-fp32-identity-v1.json", "--receipts", "out/cuda").stderr


def _basis_missing(bench: Bench) -> str:
    shutil.move(bench.checkout / "receipts" / SPLITK_BASIS, bench.home / f"moved-{SPLITK_BASIS}")
    try:
        return bench.run("qualify", "identity", "check", SPLITK_IDENTITY).stderr
    finally:
        shutil.move(bench.home / f"moved-{SPLITK_BASIS}", bench.checkout / "receipts" / SPLITK_BASIS)


def _append_to_basis_log(bench: Bench) -> Path:
    receipt = bench.checkout / "receipts" / SPLITK_BASIS
    with writable(receipt / "command.log").open("a", encoding="utf-8") as log:
        log.write("edited\n")
    return receipt


def _basis_altered(bench: Bench) -> str:
    _append_to_basis_log(bench)
    return bench.run("qualify", "identity", "check", SPLITK_IDENTITY).stderr


def _basis_rehashed(bench: Bench) -> str:
    """command.log edited and the manifest recomputed in its own byte form (a v2 manifest's RFC
    8785 bytes), so the receipt checks against itself and only the sealed digest refuses it."""
    receipt = _append_to_basis_log(bench)
    manifest = json.loads((receipt / "manifest.json").read_text())
    assert manifest["schema"] == MANIFEST_SCHEMA
    for entry in manifest["files"]:
        if entry["path"] == "command.log":
            data = (receipt / "command.log").read_bytes()
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    writable(receipt / "manifest.json").write_bytes(jcs_bytes(manifest))
    return bench.run("qualify", "identity", "check", SPLITK_IDENTITY).stderr


def _freeze(bench: Bench, run_id: str, *more: str) -> str:
    return bench.run("python", "tools/freeze_identity.py", "--lane", "nvfp4-native-splitk", *SPLITK_BOUNDS,
                     "--basis", f"receipt://{run_id}/command.log", *more).stderr


def _verify(bench: Bench, trust: str, receipt: Path) -> str:
    return bench.run("qualify", "receipts", "verify", "--trust", trust, str(receipt)).stdout


def _tampered(bench: Bench) -> str:
    copy = bench.home / "tampered" / bench.signed_receipt.name
    if not copy.exists():
        shutil.copytree(bench.signed_receipt, copy)
        with writable(copy / "command.log").open("a", encoding="utf-8") as log:
            log.write("edited\n")
    return _verify(bench, "out/trust.json", copy)


def _enroll(bench: Bench, identity: str, receipt: Path, *more: str, env: dict[str, str] | None = None) -> str:
    return bench.run("qualify", "enroll", "--identity", identity, "--receipt", str(receipt), *more, env=env).stderr


def _interrupted(bench: Bench, signum: signal.Signals) -> str:
    """A real run, signalled once its producer is ready (bounded: killed past the limit)."""
    run = subprocess.Popen(with_default_signals(["qualify", "--recipe", "native-text", "--receipts", "out/interrupted"]), cwd=bench.checkout,
                           env=bench.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(COMMAND_LIMIT_S, run.kill)
    watchdog.start()
    try:
        assert run.stdout is not None
        for line in run.stdout:
            if "producer ready" in line:
                break
        run.send_signal(signum)
        _, err = run.communicate()
    finally:
        watchdog.cancel()
    assert run.returncode == 128 + signum, (run.returncode, err)
    return err


CASES: dict[str, Callable[[Bench], str]] = {
    "vllm-missing": _vllm_missing,
    "torch-missing": _torch_missing,
    "no-cuda": _no_cuda,
    "basis-missing": _basis_missing,
    "freeze-not-copied": lambda bench: _freeze(bench, UNCOPIED_RUN, "--replace", "--write-sealed"),
    "freeze-exists": lambda bench: _freeze(bench, SPLITK_BASIS),
    "freeze-legacy-basis": lambda bench: _freeze(bench, LEGACY_RECEIPT),
    "verify-unsigned": lambda bench: _verify(bench, "out/trust.json", Path("receipts") / LEGACY_RECEIPT),
    "verify-untrusted": lambda bench: _verify(bench, "out/other-trust.json", bench.signed_receipt),
    "verify-tampered": _tampered,
    "enroll-unsigned": lambda bench: _enroll(bench, SPLITK_IDENTITY, Path("receipts") / LEGACY_RECEIPT,
                                             "--trust", "out/trust.json"),
    "enroll-untrusted": lambda bench: _enroll(bench, "contracts/nvfp4-native-w4a4-identity-v1.json",
                                              bench.signed_receipt, "--trust", "out/other-trust.json"),
    "enroll-other-identity": lambda bench: _enroll(bench, SPLITK_IDENTITY, bench.signed_receipt,
                                                   "--trust", "out/trust.json"),
    "enroll-no-trust": lambda bench: _enroll(bench, SPLITK_IDENTITY, bench.signed_receipt,
                                             env=bench.other_config("never-signed")),
    "keys-none": lambda bench: bench.run("qualify", "keys", "show", env=bench.other_config("never-signed")).stderr,
    "archive-under-file": lambda bench: (
        (bench.checkout / "out" / "notes.txt").touch(),
        bench.run("qualify", "--recipe", "native-text", "--receipts", "out/notes.txt/receipts").stderr)[1],
}
IMPORTS_TORCH = {"no-cuda"}
"""Cases that import torch (seconds before the refusal): slow tier."""
DAMAGING = {"basis-altered": _basis_altered, "basis-rehashed": _basis_rehashed}
INTERRUPTS = {"interrupted-sigint": signal.SIGINT, "interrupted-sigterm": signal.SIGTERM}


def assert_quoted(key: str, output: str) -> None:
    """The page's line for ``key`` equals a line of ``output``, both masked."""
    quoted = masked(documented()[key])
    lines = [masked(line) for line in output.splitlines()]
    assert quoted in lines, f"docs/troubleshooting.md {key}:\n  {quoted}\nreal output, masked:\n  " + "\n  ".join(lines)


def test_every_marked_message_has_a_case() -> None:
    """The page marks exactly the messages this module reproduces (none unchecked, none missing)."""
    assert set(documented()) == set(CASES) | set(DAMAGING) | set(INTERRUPTS)


def test_masking_keeps_the_words() -> None:
    """Masks replace run-specific parts only: different words still differ."""
    line = "refused: --receipts 'out/a': is under '/tmp/x/out/a', which is a file; run 20261201T001443Z-2365088d12ed757d"
    assert masked(line) == "refused: --receipts 'out/a': is under '<path>', which is a file; run <run-id>"
    assert masked(line) != masked(line.replace("is a file", "is a folder"))


@pytest.mark.parametrize("key", [pytest.param(key, marks=pytest.mark.slow) if key in IMPORTS_TORCH else key
                                 for key in sorted(CASES)])
def test_troubleshooting_message_is_what_the_harness_prints(bench: Bench, key: str) -> None:
    assert_quoted(key, CASES[key](bench))


@pytest.mark.parametrize("key", sorted(DAMAGING))
def test_troubleshooting_basis_message_is_what_the_harness_prints(fresh: Bench, key: str) -> None:
    assert_quoted(key, DAMAGING[key](fresh))


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(INTERRUPTS))
def test_troubleshooting_interrupt_message_is_what_the_harness_prints(bench: Bench, key: str) -> None:
    assert_quoted(key, _interrupted(bench, INTERRUPTS[key]))
