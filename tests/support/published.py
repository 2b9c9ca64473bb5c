"""The published model the harness has lanes for (``model-requirements.txt``); its fixture, ``published_model``, is in tests/conftest.py."""

from __future__ import annotations

NAME = "smollm2-135m-instruct-q4_1"
