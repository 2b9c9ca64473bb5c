# The README's two commands. `make test` is also what CI runs (.ci/run).
# Both install under constraints.txt, the tested pins of pyproject.toml's ranges (tools/lock.py).
.PHONY: test run
test:
	bash tools/test.sh
run:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e . && .venv/bin/qualify --recipe native-text
