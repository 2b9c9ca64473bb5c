"""docs/onboarding.md runs as written: every command of its ```sh blocks, in order, in one bash
session, in a scratch copy of the checkout whose package is the one imported.

Also the scratch-checkout helpers the other onboarding tests share (``scratch_checkout``,
``scratch_environment``): a copy of every file git tracks or would track, the venv running the
tests linked in as ``.venv``, and an environment whose ``qualify`` and ``python`` import the copy
and whose keys, registry and receipts live under the test's own directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "onboarding.md"
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)
CALIBRATE_EXAMPLE = re.compile(r"^```text\n(cell .*?)^```", re.MULTILINE | re.DOTALL)
WALKTHROUGH_LANE = "nvfp4-native-splitk"
DOC_LIMIT_S = 1800
"""A bound on the whole walk-through (about 1.5 minutes on 2 idle cores, 10 on a 2-core machine with a
load of 12): ending within it is the behaviour asserted, never how long it took."""


MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{16}"), "<run-id>"),
    (re.compile(r"[0-9a-f]{12,64}…?"), "<hex>"),
    (re.compile(r"(?<![\w.:/>])/[^\s'\",;()]+"), "<path>"),
    (re.compile(r"\b(during|after) [a-z][a-z0-9/ ]*?;"), "<when>;"),
    (re.compile(r"\d+(\.\d+)?"), "<n>"),
)


def masked(line: str) -> str:
    """``line`` with what differs from run to run replaced by placeholders."""
    for pattern, placeholder in MASKS:
        line = pattern.sub(placeholder, line)
    return line


def sh_blocks(markdown: str) -> list[str]:
    """The bodies of the ```sh fenced blocks of a markdown text, in order."""
    return [match.group(1) for match in SH_BLOCK.finditer(markdown)]


def scratch_checkout(root: Path) -> Path:
    """A copy at ``root`` of every file ``git ls-files -co --exclude-standard`` lists (tracked and
    untracked-but-not-ignored; a listed file deleted meanwhile is skipped), with ``.venv`` linking
    to the venv running these tests."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout
    root.mkdir(parents=True)
    for name in filter(None, listed.decode("utf-8", "surrogateescape").split("\0")):
        source = REPO / name
        if not os.path.lexists(source) or source.is_dir():
            continue
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    venv = Path(sys.prefix)
    assert (venv / "bin" / "activate").is_file() and (venv / "bin" / "qualify").is_file(), \
        f"the tests run outside a venv with the qualify script ({venv}); the onboarding docs assume .venv"
    (root / ".venv").symlink_to(venv, target_is_directory=True)
    return root


def scratch_environment(checkout: Path, home: Path) -> dict[str, str]:
    """The operator's environment, minus the harness's own switches and ``COLUMNS`` (so output
    piped here is as wide as the console makes it for any pipe), with the venv's bin first on
    ``PATH``, ``PYTHONPATH`` the scratch checkout (so its package, and the sealed data a freeze
    rewrites there, is the one imported), and config and data homes under ``home``."""
    env = {name: value for name, value in os.environ.items()  # COLUMNS: a pipe gets the console's own width
           if not name.startswith("QUALIFY_") and name not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "COLUMNS")}
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(checkout)
    env["XDG_CONFIG_HOME"] = str(home / "config")
    env["XDG_DATA_HOME"] = str(home / "data")
    return env


def imported_package(checkout: Path, env: dict[str, str], cwd: Path) -> Path:
    """Where ``python`` (the venv's, under ``env``) imports ``qualify`` from."""
    shown = subprocess.run([sys.executable, "-c", "import qualify; print(qualify.__file__)"], cwd=cwd, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    return Path(shown).resolve()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_doc_walkthrough_has_every_step_in_order() -> None:
    """The sh blocks hold calibrate, the freeze, the check, the qualification, the trust file,
    verify and enroll, in that order, and name no machine path (they run in any checkout)."""
    script = "\n".join(sh_blocks(DOC.read_text(encoding="utf-8")))
    steps = ["qualify calibrate", "cp -r", "tools/freeze_identity.py", "qualify identity check",
             "qualify --recipe", "qualify keys show --trust-file", "qualify receipts verify", "qualify enroll"]
    positions = [script.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), dict(zip(steps, positions, strict=True))
    assert not re.search(r"(^|\s)/(tmp|home|work|root|srv)/", script), script


def printed_commands(stdout: str) -> list[str]:
    """The lines ``qualify calibrate`` printed between the commands heading and ``receipt:``."""
    from qualify.run.onboarding import COMMANDS_HEADING

    lines = stdout.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(COMMANDS_HEADING))
    end = next(index for index, line in enumerate(lines) if index > start and line.startswith("receipt: "))
    return lines[start + 1:end]


@pytest.mark.slow
def test_doc_onboarding_runs_as_written(tmp_path: Path) -> None:
    """Every sh block of docs/onboarding.md, in one bash session (set -euo pipefail), in a scratch
    checkout: calibrate, copy and freeze, identity check, qualify, trust file, verify, enroll; all
    exit 0, and the lane ends sealed on the new basis and enrolled, the real checkout untouched.

    Then the command lines that same real calibration printed (qualify/run/onboarding.py), with the
    checkout put back as it was before the freeze (no copied receipt, the shipped identity and
    sealed digests), pasted verbatim into bash in another directory: they exit 0, and the identity
    they froze cites that receipt, now under receipts/, and passes ``qualify identity check`` run
    from that other directory. (One calibration serves both: a calibration takes minutes.)"""
    checkout = scratch_checkout(tmp_path / "checkout")
    env = scratch_environment(checkout, tmp_path)
    assert imported_package(checkout, env, checkout) == (checkout / "qualify" / "__init__.py").resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert imported_package(checkout, env, elsewhere) == (checkout / "qualify" / "__init__.py").resolve()
    sealed = checkout / "qualify" / "contract" / "sealed_data.py"
    sealed_before = file_sha256(REPO / "qualify" / "contract" / "sealed_data.py")
    assert file_sha256(sealed) == sealed_before

    script = "set -euo pipefail\n" + "\n".join(sh_blocks(DOC.read_text(encoding="utf-8")))
    done = subprocess.run(["bash", "-c", script], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=DOC_LIMIT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"

    identity_file = checkout / "contracts" / f"{WALKTHROUGH_LANE}-identity-v1.json"
    identity = json.loads(identity_file.read_text())
    calibrations = sorted(path.name for path in (checkout / "out" / "onboarding").iterdir())
    basis_run = identity["onboarding_qualification"]["basis"].removeprefix("receipt://").partition("/")[0]
    assert basis_run == calibrations[0] and (checkout / "receipts" / basis_run / "manifest.json").is_file()
    assert "1 verified (1 passed)" in done.stdout, done.stdout[-2000:]
    printed = {masked(line) for line in done.stdout.splitlines()}
    example = CALIBRATE_EXAMPLE.search(DOC.read_text(encoding="utf-8"))
    assert example is not None
    missing = [line for line in example.group(1).splitlines() if masked(line) not in printed]
    assert not missing, f"docs/onboarding.md quotes calibrate output it no longer prints: {missing}"
    registry = json.loads((tmp_path / "data" / "trust-ladder" / "lane-registry.json").read_text())
    assert [entry["lane"] for entry in registry["entries"]] == [WALKTHROUGH_LANE]
    assert file_sha256(REPO / "qualify" / "contract" / "sealed_data.py") == sealed_before
    assert file_sha256(sealed) != sealed_before

    # The calibration's printed commands, from the same run, pasted where the doc's freeze had not run.
    commands = printed_commands(done.stdout)
    assert shlex.split(commands[0]) == ["cd", str(checkout.resolve())], commands
    copied = checkout / "receipts" / basis_run
    for directory in (copied, *(path for path in copied.rglob("*") if path.is_dir())):
        directory.chmod(0o755)  # a finalized receipt is read-only
    shutil.rmtree(copied)
    shutil.copy2(REPO / "qualify" / "contract" / "sealed_data.py", sealed)
    shutil.copy2(REPO / "contracts" / identity_file.name, identity_file)
    pasted = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(commands)], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=DOC_LIMIT_S)
    assert pasted.returncode == 0, f"{commands}\n{pasted.stdout}\n{pasted.stderr}"
    identity = json.loads(identity_file.read_text())
    assert identity["onboarding_qualification"]["basis"] == f"receipt://{basis_run}/command.log"
    assert (copied / "manifest.json").is_file()
    assert file_sha256(sealed) != sealed_before
    checked = subprocess.run(["qualify", "identity", "check", str(identity_file)], cwd=elsewhere, env=env,
                             capture_output=True, text=True, timeout=DOC_LIMIT_S)
    assert checked.returncode == 0 and f": valid: lane {WALKTHROUGH_LANE}" in checked.stdout, checked
