"""``qualify report RECEIPT... [--output FILE.html] [--trust FILE]``: one self-contained HTML page
per run, or a comparison of several (docs/report.md).

Exit codes: 0 the page is written and every receipt on it verified; 1 the page is written but a
receipt on it is not verified (unsigned, untrusted, tampered or partial: the page says so in a red
banner, never silently); 2 refused, nothing written: a path that is no receipt, a summary that
cannot be read, an unusable trust file or an output that cannot be written. The page is written to
a temporary file beside the output and renamed over it, so a refusal never leaves a partial page.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from qualify.archive.keys import TrustFile, default_trust_path, load_trust
from qualify.core.arguments import (
    OneLineParser,
    path_argument,
    require_writable_file,
    say_refusal,
    shown,
)
from qualify.core.errors import Refused

EXIT_WRITTEN = 0
EXIT_NOT_VERIFIED = 1
EXIT_REFUSED = 2
MAX_RECEIPTS = 12
"""The most receipts one comparison page holds (one colour each on the overlaid plot)."""

_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def build_parser() -> argparse.ArgumentParser:
    """``qualify report``'s arguments."""
    parser = OneLineParser(
        prog="qualify report",
        description="Write one self-contained HTML page of a receipt (verdict, scope, drift against the "
                    "bounds, KV against the calibrated envelope, host and identity), or a comparison of "
                    "several receipts. Exit 0 written and verified, 1 written but a receipt is not "
                    "verified, 2 refused (nothing written).")
    parser.add_argument("receipts", nargs="+", metavar="RECEIPT", type=path_argument,
                        help=f"receipt directories (one: a report; 2 to {MAX_RECEIPTS}: a comparison)")
    parser.add_argument("--output", "-o", metavar="FILE.html", type=path_argument, default=None,
                        help="the page to write (default: report-<run id>.html in the current directory)")
    parser.add_argument("--trust", metavar="FILE", type=path_argument, default=None,
                        help="trust file of public keys (default: the operator's, when it exists)")
    return parser


def default_output(receipts: Sequence[Path]) -> Path:
    """``report-<run id>.html`` for one receipt, ``report-compare-<first run id>-and-<n>.html``."""
    first = _UNSAFE_NAME.sub("_", receipts[0].absolute().name)[:100] or "receipt"
    if len(receipts) == 1:
        return Path(f"report-{first}.html")
    return Path(f"report-compare-{first}-and-{len(receipts) - 1}.html")


def _check_output(output: Path, receipts: Sequence[Path]) -> Path:
    """Refuse an output that cannot be written, or that lies inside a receipt (a receipt is never
    written to: a page inside one would make it fail verification)."""
    require_writable_file("--output", output)
    for receipt in receipts:
        with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: a link loop, no receipt there
            if output.absolute().resolve().is_relative_to(receipt.absolute().resolve()):
                raise Refused(f"--output {shown(str(output))}: is inside receipt {shown(str(receipt))}; "
                              f"expected a path outside every receipt (receipts are never written to)")
    return output


def write_atomically(output: Path, data: bytes, option: str = "--output") -> None:
    """Write ``data`` to a temporary file beside ``output`` and rename it over ``output``: the
    file appears whole or not at all (the temporary is removed on any failure); a refusal names
    ``option``. Also ``qualify producer expect --out``'s writer."""
    where = f"{option} {shown(str(output))}"
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=".qualify-", suffix=".tmp",
                                                 dir=output.absolute().parent)
    except OSError as exc:
        raise Refused(f"{where}: cannot write there ({exc.strerror or type(exc).__name__})") from None
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)  # a page or document to share, not a secret (mkstemp makes it 0600)
        os.replace(temporary, output)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise Refused(f"{where}: cannot write ({exc.strerror or type(exc).__name__})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _trust(option: Path | None) -> TrustFile | None:
    """``--trust FILE``, else the operator's trust file when it exists, else none (a signed
    receipt then reads as untrusted, as ``qualify receipts verify`` reads it)."""
    path = option or default_trust_path()
    return load_trust(path) if option is not None or os.path.lexists(path) else None


def render_report(receipts: Sequence[Path], output: Path, trust_option: Path | None = None) -> int:
    """Check the output, read the receipts, write the page; returns the exit code (0 or 1) and
    raises :class:`Refused` before anything is written."""
    from qualify.interfaces.report_data import load_receipt
    from qualify.interfaces.report_html import compare_page, single_page, status_label

    if len(receipts) > MAX_RECEIPTS:
        raise Refused(f"RECEIPT: found {len(receipts)} receipts, expected at most {MAX_RECEIPTS} on one page")
    _check_output(output, receipts)
    trust = _trust(trust_option)
    views = [load_receipt(receipt, trust) for receipt in receipts]
    page = single_page(views[0]) if len(views) == 1 else compare_page(views)
    data = page.encode("utf-8")
    write_atomically(output, data)
    for view in views:
        signature = "verified" if view.verified else f"NOT VERIFIED ({view.state})"
        print(f"report: {view.run_id}: {status_label(view.status, soak=view.soak)}, signature {signature}")
    print(f"report: wrote {output} ({len(data)} bytes)")
    return EXIT_WRITTEN if all(view.verified for view in views) else EXIT_NOT_VERIFIED


def report_cli(argv: Sequence[str]) -> int:
    """``qualify report RECEIPT... [--output FILE.html] [--trust FILE]`` (module docstring)."""
    parser = build_parser()
    try:
        options = parser.parse_args(list(argv))
    except SystemExit as exit_:
        return EXIT_WRITTEN if exit_.code == 0 else EXIT_REFUSED
    receipts: list[Path] = options.receipts
    output: Path = options.output or default_output(receipts)
    try:
        return render_report(receipts, output, options.trust)
    except Refused as refusal:
        say_refusal(f"qualify report: {refusal}")
        return EXIT_REFUSED
    except OSError as exc:  # a path the checks could not even inspect (a directory we may not enter)
        where = f" {shown(exc.filename)}" if isinstance(exc.filename, str) else ""
        say_refusal(f"qualify report:{where} cannot be read ({exc.strerror or type(exc).__name__})")
        return EXIT_REFUSED
    finally:
        sys.stdout.flush()
