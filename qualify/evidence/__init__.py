"""The evidence of a handoff: the handoff branch compared with the consumer's cold recompute (numpy,
or torch on a device), the sample records and series a receipt keeps, and the controls' measures.
Nothing here judges (:mod:`qualify.judge` does).

May import :mod:`qualify.core`, :mod:`qualify.contract` and :mod:`qualify.engines`; never its
sibling :mod:`qualify.handoff` or anything above (import-linter, ``pyproject.toml``).
"""
