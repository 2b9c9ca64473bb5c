"""The harness's shipped assets, in an installed wheel: ``contracts/``, ``model/`` and ``receipts/``.

In a checkout this package is empty and those folders stay at the top level (the house layout);
pyproject.toml maps them here as package data when a wheel is built. Only
:mod:`qualify.core.assets` opens it, through ``importlib.resources``, to find those folders.
"""
