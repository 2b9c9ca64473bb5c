#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the pinned runtime wheels the harness needs on the GPU
# machine, which has python 3.12, torch and transformers but no network and none of pydantic,
# jsonschema or gguf. The runtime dependencies are read from pyproject.toml at the versions
# constraints.txt pins (the tested set, which the identities' numeric pins match); the wheels' own
# dependencies that the machine lacks are pinned here to the versions `make test` installs. Run
# here, before a GPU call that carries `.whl`; on the GPU machine, `source tools/device_env.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
locked = dict(line.strip().split("==", 1) for line in open("constraints.txt")
              if "==" in line and not line.lstrip().startswith("#"))
# safetensors and tokenizers are on the GPU machine's image; matplotlib only draws `qualify report`
# pages, which are made off the GPU machine. The rest travel, at their locked versions.
names = [re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", dep).group(0)).lower() for dep in deps]
print(" ".join(f"{name}=={locked[name]}" for name in names if name not in {"safetensors", "tokenizers", "matplotlib"}))
PY
)
transitive="pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
cffi==2.1.1 pycparser==3.12"
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins $transitive
ls .whl | wc -l | xargs echo "device_wheels.sh: wheels in .whl:"
