# The README's commands. Tiers and their times: README ("Tests") and docs/testing.md.
# All install under constraints.txt, the tested pins of pyproject.toml's ranges (tools/lock.py).
.PHONY: check test run
check:
	bash tools/test.sh check
test:
	bash tools/test.sh test
run:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e . && .venv/bin/qualify --recipe native-text
