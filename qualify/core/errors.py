"""The harness's error types: each carries one line an operator can act on."""

from __future__ import annotations


class Refused(Exception):
    """A contract, input or handoff was refused (fail closed). CLI exit code 2.

    The message is one line naming the field or file, what was found and what was expected.
    """


class HandoffRefused(Refused):
    """The consumer refused to install a handoff (MAC, digest, cache identity or geometry).

    ``check`` names the check that refused (``"mac"``, ``"manifest.lane"``, ``"payload.bytes"``,
    ...), so a receipt can record which one without parsing the message.
    """

    def __init__(self, message: str, *, check: str = "handoff") -> None:
        super().__init__(message)
        self.check = check


class ProducerFailed(Exception):
    """The producer reported an error, died, or was stopped by its watchdog."""


def one_line(message: str) -> str:
    """Collapse a message to a single line so refusals never spill tracebacks or blocks."""
    return " ".join(str(message).split())
