"""What every command's arguments share: one-line usage errors and refusals, and path options
checked before any step runs (an empty, unwritable or misplaced path is refused, never used)."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from qualify.core.errors import Refused, one_line

# The exit status of a usage error (argparse's, and the harness's "refused").
EXIT_USAGE = 2

# Control characters a terminal would act on (escape sequences, bells, backspaces); the
# whitespace ones are already collapsed by one_line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SHOWN_CHARACTERS = 200


# --------------------------------------------------------------------------- one-line refusals


def printable_line(message: str) -> str:
    """``message`` as one line any terminal or pipe takes: whitespace collapsed, control
    characters and lone surrogates (an argument can carry either) escaped."""
    line = one_line(message).encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", line)


def shown(text: str) -> str:
    """An operator's argument quoted for a refusal, cut to a readable length."""
    if len(text) <= _SHOWN_CHARACTERS:
        return repr(text)
    return f"{text[:_SHOWN_CHARACTERS]!r}… ({len(text)} characters)"


def say_refusal(message: str) -> None:
    """Write ``message`` to stderr as exactly one line (plain, for handlers without a console)."""
    sys.stderr.write(printable_line(message) + "\n")
    sys.stderr.flush()


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit 2, never a usage block
    (``--help`` is unchanged). Abbreviated options are not accepted: ``--receipt`` is not
    ``--receipts`` and a typo never lands on a neighbouring option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        say_refusal(f"{self.prog}: error: {message}")
        raise SystemExit(EXIT_USAGE)


# --------------------------------------------------------------------------- path options


def path_argument(text: str) -> Path:
    """argparse ``type`` of every path option: refuses an empty path (it would mean the current
    directory), a NUL byte, text the filesystem cannot encode and a ``~`` that cannot expand."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"found an empty path {shown(text)}, expected a path")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"found a NUL byte in {shown(text)}, expected a path")
    try:
        os.fsencode(text)
        return Path(text).expanduser()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"found {shown(text)}, which the filesystem cannot encode, expected a path") from None
    except RuntimeError:  # pathlib: "~user" with no such user, or "~" with no home directory
        raise argparse.ArgumentTypeError(f"found {shown(text)}: cannot expand '~', expected a path") from None


def _nearest_existing(path: Path) -> Path:
    """``path`` itself or its closest ancestor that exists (a dangling link counts as existing)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or ".")


def _directory_problem(directory: Path, named: Path) -> str | None:
    """Why ``directory`` cannot be (or be made) a writable directory, in words about ``named``
    (the directory itself, or a file to be written in it); None when it can. Nothing is created:
    a probe file is made and removed in the nearest existing directory, which holds for root too,
    where permission bits do not."""
    try:
        absolute, target = directory.absolute(), named.absolute()
        existing = _nearest_existing(absolute)
        if not existing.is_dir():
            if existing == target:
                return "is a file or other non-directory, expected a directory"
            return f"is under {shown(str(existing))}, which is a file or other non-directory"
        descriptor, probe = tempfile.mkstemp(prefix=".qualify-write-probe-", dir=existing)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write there ({exc.strerror or type(exc).__name__}), expected a writable directory"
    except ValueError as exc:  # a path os functions refuse outright (path_argument screens most)
        return f"not a usable path ({one_line(str(exc))})"
    return None


def require_writable_directory(option: str, path: Path) -> Path:
    """Refuse, in one line naming ``option``, an output directory that exists as something else,
    sits under a non-directory, or cannot be written; nothing is created."""
    problem = _directory_problem(path, path)
    if problem is not None:
        raise Refused(f"{option} {shown(str(path))}: {problem}")
    return path


def require_writable_file(option: str, path: Path) -> Path:
    """Refuse an output file that exists as a directory or a non-regular file, or whose directory
    cannot be written (files are replaced atomically through a temporary beside them)."""
    where = f"{option} {shown(str(path))}"
    try:
        if os.path.lexists(path) and not path.is_file():
            raise Refused(f"{where}: is a directory or other non-regular file, expected a regular file")
    except (OSError, ValueError) as exc:
        raise Refused(f"{where}: cannot inspect it ({one_line(str(exc))})") from None
    problem = _directory_problem(path.absolute().parent, path)
    if problem is not None:
        raise Refused(f"{where}: {problem}")
    return path


def require_directory(option: str, path: Path) -> Path:
    """Refuse an input directory that does not exist or is not a directory."""
    try:
        if path.is_dir():
            return path
        exists = os.path.lexists(path)
    except (OSError, ValueError) as exc:
        raise Refused(f"{option} {shown(str(path))}: cannot inspect it ({one_line(str(exc))})") from None
    found = "is not a directory" if exists else "no such directory"
    raise Refused(f"{option} {shown(str(path))}: {found}, expected a directory")


def require_regular_file(option: str, path: Path) -> Path:
    """Refuse an input file that is missing, a directory, or not a regular file (a FIFO or a
    device would block or never end)."""
    where = f"{option} {shown(str(path))}"
    try:
        if path.is_file():
            return path
        exists = os.path.lexists(path)
        directory = path.is_dir()
    except (OSError, ValueError) as exc:
        raise Refused(f"{where}: cannot inspect it ({one_line(str(exc))})") from None
    found = "is a directory" if directory else "is not a regular file" if exists else "no such file"
    raise Refused(f"{where}: {found}, expected a regular file")


def require_private_file(where: str, path: Path, missing: str) -> os.stat_result:
    """A secret's file (a signing or handoff key): a regular file, not a link, that only its owner
    can read; refused in one line starting ``where``, ``missing`` saying what to do when absent."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise Refused(f"{where}: {missing}") from None
    if not stat.S_ISREG(info.st_mode):
        raise Refused(f"{where}: not a regular file")
    if info.st_mode & 0o077:
        raise Refused(f"{where}: mode {stat.S_IMODE(info.st_mode):04o} lets others read it; expected 0600")
    return info


MAX_DEADLINE_S = 7 * 24 * 3600.0
"""The longest producer phase limit (a week): longer is a typo, never a real phase's time."""


DECIMAL_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A number as an operator types it: a sign, ASCII digits, an optional fraction and exponent; not the
underscores, surrounding spaces, other scripts' digits, ``inf`` or ``nan`` that ``float`` accepts."""


def deadline_seconds(text: str) -> float:
    """``--deadline-s``: a positive finite number of seconds, in ASCII decimal notation."""
    if not DECIMAL_NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"found {shown(text)}, expected a number of seconds")
    value = float(text)
    if not (0 < value <= MAX_DEADLINE_S):
        raise argparse.ArgumentTypeError(
            f"found {shown(text)}, expected a positive number of seconds, at most {MAX_DEADLINE_S:.0f}")
    return value


WHOLE_NUMBER = re.compile(r"[0-9]+")
"""A count as an operator types it: ASCII digits only (no sign, underscores, spaces or other scripts' digits)."""


def whole_number_from(minimum: int) -> Callable[[str], int]:
    """A parser of whole numbers of at least ``minimum`` in ASCII digits (a port, a descriptor, a
    count): ``int`` alone would take ``1_000``, `` 5`` and other scripts' digits."""
    def whole(text: str) -> int:
        if not WHOLE_NUMBER.fullmatch(text) or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"found {shown(text)}, expected a whole number of at least {minimum}")
        return int(text)

    return whole


whole_number = whole_number_from(1)
"""A count such as ``--handoffs``: a positive whole number in ASCII digits."""


def rate_gbit_per_s(text: str) -> float:
    """A rate such as ``--link-floor``: a positive finite number of Gbit/s, in ASCII decimal notation."""
    if not DECIMAL_NUMBER.fullmatch(text) or not (0 < float(text) < float("inf")):
        raise argparse.ArgumentTypeError(f"found {shown(text)}, expected a positive number of Gbit/s")
    return float(text)
