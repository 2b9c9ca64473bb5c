# Source on the GPU machine (repo root, `.whl` carried): installs the carried wheels into
# /tmp/site and puts them and this checkout on PYTHONPATH, so `python3 -m qualify.interfaces.cli` runs with
# the machine's own torch and transformers. Fails the call if the wheels are missing.
if [ ! -d .whl ]; then echo "device_env.sh: .whl missing (run tools/device_wheels.sh here and carry .whl)" >&2; return 1 2>/dev/null || exit 1; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || { echo "device_env.sh: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
