"""HTTP at the edge of a served-pair run: JSON over HTTP to a running ``vllm serve`` instance,
with bounded timeouts, every failure one :class:`~qualify.core.errors.Refused` line naming the
option the endpoint came from (``--prefill-url`` or ``--decode-url``). Standard library only
(``urllib``); nothing here judges or knows vLLM's request fields beyond the paths it calls.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from qualify.core.errors import Refused, one_line

CHECK_TIMEOUT_S = 10.0
"""Seconds a check request (``/version``, ``/v1/models``, ``/metrics``) may take: a URL that does
not answer is refused after this, never waited on."""
MAX_BODY_BYTES = 512 * 1024 * 1024
"""The largest response body read (full-vocabulary logprobs of 256 positions of a large vocab fit)."""


def parse_base_url(option: str, text: str) -> str:
    """An ``http://`` or ``https://`` base URL with a host, without query or fragment; the base
    without its trailing slash. Refused in one line naming ``option``."""
    parsed = urllib.parse.urlsplit(text.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise Refused(f"{option} {text!r}: expected an http:// or https:// URL with a host (a vllm serve instance)")
    if parsed.query or parsed.fragment:
        raise Refused(f"{option} {text!r}: expected a base URL without query or fragment")
    try:
        _ = parsed.port  # a port out of range raises here
    except ValueError:
        raise Refused(f"{option} {text!r}: the port is not a number from 0 to 65535") from None
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, parsed.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class HttpAnswer:
    """A response: its status and body (an error status is an answer too)."""

    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))


@dataclass(frozen=True)
class Endpoint:
    """One server of the pair: the option that named it and its base URL."""

    option: str
    base: str

    def _request(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> HttpAnswer:
        url = self.base + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return HttpAnswer(int(response.status), response.read(MAX_BODY_BYTES + 1))
        except urllib.error.HTTPError as exc:
            return HttpAnswer(int(exc.code), exc.read(64 * 1024) if exc.fp is not None else b"")
        except TimeoutError:
            raise Refused(f"{self.option} {self.base}: {path} did not answer within {timeout_s:g} s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise Refused(f"{self.option} {self.base}: {path} did not answer within {timeout_s:g} s") from None
            reason = exc.reason if isinstance(exc.reason, str) else (
                getattr(exc.reason, "strerror", None) or type(exc.reason).__name__)
            raise Refused(f"{self.option} {self.base}: does not answer ({one_line(str(reason))})") from None
        except (OSError, ValueError) as exc:  # a reset connection, a malformed response line
            raise Refused(f"{self.option} {self.base}: {path}: {type(exc).__name__}: {one_line(str(exc))[:160]}") from None

    def get(self, path: str, timeout_s: float | None = None) -> HttpAnswer:
        return self._request(path, None, CHECK_TIMEOUT_S if timeout_s is None else timeout_s)

    def post(self, path: str, body: dict[str, Any], timeout_s: float) -> HttpAnswer:
        return self._request(path, body, timeout_s)

    def get_json(self, path: str, what: str, timeout_s: float | None = None) -> Any:
        """GET ``path``'s JSON document; refused (naming ``what`` the server is expected to be)
        for an error status or a body that is not JSON."""
        answer = self.get(path, timeout_s)
        if answer.status != 200:
            raise Refused(f"{self.option} {self.base}: {path} answered HTTP {answer.status}; expected {what}")
        try:
            return answer.json()
        except (UnicodeDecodeError, ValueError):
            raise Refused(f"{self.option} {self.base}: {path} is not JSON; expected {what}") from None

    def post_json(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
        """POST ``body``; (status, JSON document or None when the body is not JSON)."""
        answer = self.post(path, body, timeout_s)
        if len(answer.body) > MAX_BODY_BYTES:
            raise Refused(f"{self.option} {self.base}: {path} answered more than {MAX_BODY_BYTES} bytes")
        try:
            return answer.status, answer.json()
        except (UnicodeDecodeError, ValueError):
            return answer.status, None
