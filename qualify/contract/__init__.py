"""What is fixed before a run: the lane table and cache identities, frozen onboarding identities
and their seals, the lane registry, the preregistered controls criteria and calibration set, the
stated rules and logit units.

May import :mod:`qualify.core` only (import-linter, ``pyproject.toml``).
"""
