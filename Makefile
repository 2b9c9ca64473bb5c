# The README's two commands. `make test` is also what CI runs (.ci/run).
.PHONY: test run
test:
	bash tools/test.sh
run:
	python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/qualify --recipe native-text
