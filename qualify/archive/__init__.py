"""Receipts: their layout, writing and sealing with the judge's verdict, the signed statement and the
operator's signing key and trust files, verification, and reading verified receipts back.

May import every layer below it (:mod:`qualify.core` to :mod:`qualify.judge`); never
:mod:`qualify.run` or :mod:`qualify.interfaces` (import-linter, ``pyproject.toml``).
"""
