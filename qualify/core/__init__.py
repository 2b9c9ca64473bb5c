"""The harness's base: SHA-256 and canonical JSON, strict JSON for untrusted input, the one-line
errors, shipped assets, machine-independent numerics and statistics, the host's numeric
environment, the canonical KV layout, the chosen model, and what every command's arguments share.

The bottom layer: imports no other package of ``qualify`` (import-linter, ``pyproject.toml``).
"""
