"""Red-team findings on the ``qualify`` command line, one test per finding: path options refused
before any step, "cannot run this lane here" exits 2 (with a receipt marked refused once one
exists), and every usage error fits on one line."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from qualify.archive.keys import init_key
from qualify.core import arguments
from qualify.interfaces import cli
from tests.conftest import isolate_cli_environment
from tests.support.receipt_forgery import check, write_receipt

REPO = Path(__file__).resolve().parents[3]
CHECKOUT_RECEIPTS = REPO / "receipts"
GPU_IDENTITY = REPO / "contracts" / "transformers-cuda-fp32-identity-v1.json"


def tree(root: Path) -> set[str]:
    """Every path under ``root`` (relative), to show nothing was written there."""
    return {path.relative_to(root).as_posix() for path in root.rglob("*")} if root.exists() else set()


class Places:
    """An isolated working directory, default receipt archive and data home for one test."""

    def __init__(self, root: Path) -> None:
        self.cwd = root / "cwd"
        self.archive = root / "archive"
        self.data = root / "data"
        self.fixtures = root / "fixtures"
        for directory in (self.cwd, self.archive, self.data, self.fixtures):
            directory.mkdir()
        self.file = self.fixtures / "a-file"
        self.file.write_text("not a directory\n")
        self.identity = self.fixtures / "identity.json"
        self.identity.write_text("{}\n")
        self.checkout_receipts = tree(CHECKOUT_RECEIPTS)
        self.data_before: set[str] = set()

    def assert_nothing_written(self) -> None:
        assert tree(self.cwd) == set()
        assert tree(self.archive) == set()
        assert tree(self.data) == self.data_before
        assert tree(CHECKOUT_RECEIPTS) == self.checkout_receipts


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Places]:
    made = Places(tmp_path)
    isolate_cli_environment(monkeypatch, cwd=made.cwd, archive=made.archive, data=made.data)
    init_key()  # the operator's signing key exists (a first run announces making one, on stderr)
    made.data_before = tree(made.data)
    yield made


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refusal_line(result: tuple[int, str, str]) -> str:
    """The one stderr line of an exit-2 refusal (never a traceback or an internal error)."""
    code, out, err = result
    assert code == 2, (out, err)
    assert "Traceback" not in out + err and "internal error" not in out + err, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), err
    return lines[0]


# -- finding: `--receipts ""` ran a full qualification and wrote the receipt into the checkout --


@pytest.mark.parametrize("argv", [
    ["--recipe", "native-text", "--receipts", ""],
    ["--recipe=native-text", "--receipts=", "--receipts"],
    ["--recipe", "native-text", "--receipts", "  "],
    ["calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16", "--receipts", ""],
    ["selftest", "--receipts", ""],
    ["enroll", "--identity", "IDENTITY", "--receipt", "r", "--keys", ""],
    ["enroll", "--identity", "IDENTITY", "--receipt", "r", "--registry", ""],
    ["enroll", "--identity", "IDENTITY", "--receipt", "r", "--receipts", ""],
    ["receipts", "verify", ""],
], ids=lambda argv: " ".join(argv[:2]) + " " + argv[-2])
def test_empty_receipts_is_refused_before_any_step_and_writes_nothing(
    places: Places, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    argv = [str(places.identity) if word == "IDENTITY" else word for word in argv]
    code, out, err = run(capsys, *argv)
    line = refusal_line((code, out, err))
    option = "PATH" if argv[0] == "receipts" else argv.pop() if argv[-1] == "--receipts" else argv[-2]
    assert f"argument {option}: found an empty path" in line, line
    assert "identity sealed" not in out  # no step ran
    places.assert_nothing_written()


# -- finding: `--receipts` at a file or an unwritable path, and `enroll --keys` likewise, gave
# -- "internal error"


def _unwritable(places: Places, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory this process cannot write: permission bits for a normal user; for root (who
    writes anywhere) the probe's file creation is made to fail as EACCES would."""
    directory = places.fixtures / "read-only"
    directory.mkdir()
    if os.geteuid() == 0:
        real_mkstemp = arguments.tempfile.mkstemp

        def mkstemp(*args: object, dir: Path, **kwargs: object) -> tuple[int, str]:
            if Path(dir) == directory:
                raise PermissionError(13, "Permission denied")
            return real_mkstemp(*args, dir=dir, **kwargs)  # type: ignore[call-overload, no-any-return]

        monkeypatch.setattr(arguments.tempfile, "mkstemp", mkstemp)
    else:
        directory.chmod(0o555)
    return directory


@pytest.mark.parametrize("where", ["file", "under-file", "unwritable"])
@pytest.mark.parametrize("command", [
    ["--recipe", "native-text", "--receipts"],
    ["calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16", "--receipts"],
    ["selftest", "--fault", "kv-ulp", "--receipts"],
    ["enroll", "--identity", "IDENTITY", "--receipt", "r", "--keys"],
    ["enroll", "--identity", "IDENTITY", "--receipt", "r", "--registry"],
], ids=lambda argv: " ".join(argv[:1] + argv[-1:]))
def test_receipts_or_keys_at_a_file_or_unwritable_path_is_refused_not_an_internal_error(
    places: Places, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    command: list[str], where: str,
) -> None:
    option = command[-1]
    if where == "file":
        # --registry names a file: a directory is what it cannot be.
        target = places.fixtures if option == "--registry" else places.file
    elif where == "under-file":
        target = places.file / "sub" / ("registry.json" if option == "--registry" else "dir")
    else:
        target = _unwritable(places, monkeypatch) / ("registry.json" if option == "--registry" else "archive")
    argv = [str(places.identity) if word == "IDENTITY" else word for word in command]
    code, out, err = run(capsys, *argv, str(target))
    line = refusal_line((code, out, err))
    assert line.startswith(("refused: " + option, option)) and repr(str(target)) in line, line
    expected = {"file": "expected a regular file" if option == "--registry" else "expected a directory",
                "under-file": f"is under {str(places.file)!r}",
                "unwritable": "cannot write there (Permission denied)"}[where]
    assert expected in line, line
    assert out == ""  # refused before any step or handoff, before a key is minted
    places.assert_nothing_written()


# -- finding: a GPU identity on a CPU machine, and `--producer vllm` without vLLM, exited 1 with a
# -- failing receipt where they should exit 2


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("engines", [["--producer", "vllm"], ["--consumer", "vllm"]])
def test_vllm_lane_without_vllm_installed_exits_2_with_one_line(
    places: Places, capsys: pytest.CaptureFixture[str], engines: list[str]
) -> None:
    line = refusal_line(run(capsys, "--recipe", "native-text", *engines))
    assert line == "refused: identity sealed: vllm: not installed (run tools/install_vllm.sh)", line
    assert_one_refused_receipt(places, "vllm: not installed")


def assert_one_refused_receipt(places: Places, reason: str) -> None:
    """Exactly one receipt, in the archive only, signed and verified, its verdict 'refused' with ``reason``."""
    from qualify.archive.verify import verify_receipt

    receipts = [path for path in places.archive.iterdir() if path.is_dir()]
    assert len(receipts) == 1, receipts
    assert verify_receipt(receipts[0]) == []
    checked = check(receipts[0])
    assert (checked.state, checked.status, checked.problems) == ("verified", "refused", []), checked
    summary = json.loads((receipts[0] / "validation-summary.json").read_text())
    assert summary["passed"] is False and summary["error"].startswith("refused: identity sealed: ")
    assert reason in summary["error"]
    assert tree(places.cwd) == set() and tree(places.data) == places.data_before
    assert tree(CHECKOUT_RECEIPTS) == places.checkout_receipts


class _RefusingProducer:
    """A producer that refuses to start, as one with no GPU (or no vLLM) for its lane does."""

    host_facts = None
    host_facts_problem = "the producer refused to start"
    ready_silence_s = 0.0

    def __init__(self, setup: object) -> None:
        self.closed = False

    def start(self) -> None:
        from qualify.handoff.client import ProducerStartRefused

        raise ProducerStartRefused("producer refused to start: engine device: 'cuda' requested but torch "
                                   "sees no CUDA device", exit_status=2, producer_message="no CUDA device")

    def request_prefill(self, prompt: object, request_id: str) -> object:
        raise AssertionError("a producer that refused to start is never asked for a handoff")

    def close(self) -> None:
        self.closed = True


def test_producer_refusing_to_start_exits_2_with_a_receipt_marked_refused(
    places: Places, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qualify.archive.reader import read_receipt_json
    from qualify.run import qualification

    monkeypatch.setattr(qualification, "producer_process", _RefusingProducer)
    code, out, err = run(capsys, "--recipe", "native-text", "--reference-once")
    line = refusal_line((code, out, err))
    assert line.startswith("refused: producer ready: producer refused to start: ") and "no CUDA device" in line
    receipts = sorted(places.archive.iterdir())  # one published receipt, no .partial- leftover
    assert len(receipts) == 1 and not receipts[0].name.startswith(".") and f"receipt: {receipts[0]} (refused)" in out
    summary = read_receipt_json(receipts[0], "validation-summary.json")
    assert summary["passed"] is False and summary["samples"] == 0
    assert summary["verdict"].startswith("refused: producer ready: ") and summary["error"] == summary["verdict"]
    assert {"name": "lane runs here", "passed": False, "detail": line.removeprefix("refused: ")} in summary["checks"]
    assert "REFUSED" in (receipts[0] / "command.log").read_text()
    capsys.readouterr()
    code, out, err = run(capsys, "receipts", "verify", str(receipts[0]))  # the refused receipt is intact
    assert (code, err, out.splitlines()[-1]) == (0, "", "1 receipts: 1 verified (1 refused)"), out


def test_judge_refused_is_a_refused_verdict_not_a_failure() -> None:
    from qualify.judge import judge_incomplete, judge_refused

    verdict = judge_refused("producer ready: no\nCUDA device")
    assert verdict.refused and not verdict.passed
    assert verdict.headline == "refused: producer ready: no CUDA device" == verdict.error
    assert not judge_incomplete("step failed").refused


# -- finding: argparse errors took 2-4 lines


USAGE_ERRORS = [
    [],
    ["--no-such-option"],
    ["--recipe"],
    ["--recipe", "fast-and-loose"],
    ["bogus"],
    ["identity"],
    ["identity", "check"],
    ["identity", "check", "a.json", "b.json"],
    ["receipts"],
    ["receipts", "verify", "--no-such-option"],
    ["producer"],
    ["--recipe", "native-text", "--producer", "nope"],
    ["--recipe", "native-text", "stray"],
    ["--recipe", "native-text", "--identity"],
    ["--recipe", "native-text", "--deadline-s", "nan"],
    ["--recipe", "native-text", "--deadline-s", "1_000"],  # float() takes these three; an operator's number is none
    ["--recipe", "native-text", "--deadline-s", " 5"],
    ["--recipe", "native-text", "--deadline-s", "\uff15"],
    ["keys", "tls", "--valid-days", "\uff13"],
    ["soak", "--handoffs", "1_00", "--link-floor", "1"],
    ["soak", "--handoffs", "100", "--link-floor", "nan"],
    ["--version", "extra"],
    ["--recipe", "native-text", "--version"],
    ["--recipe", "native-text", "--rec", "x"],
    ["calibrate"],
    ["calibrate", "--recipe", "native-text", "--lane", "no-such-lane"],
    ["calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16", "--anchors", "-3"],
    ["calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16", "--anchors", "1e9"],
    ["selftest", "--no-such-option"],
    ["enroll"],
    ["enroll", "--identity", "x", "--receipt", "r", "--bogus"],
]


@pytest.mark.parametrize("argv", USAGE_ERRORS, ids=lambda argv: " ".join(argv) or "(none)")
def test_argparse_errors_fit_on_one_line(places: Places, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    line = refusal_line(run(capsys, *argv))
    assert "usage:" not in line
    assert line.startswith(("qualify", "refused: qualify")), line
    places.assert_nothing_written()


@pytest.mark.parametrize(("option", "value"), [
    ("--port", "7_443"), ("--warmup-tokens", " 8"), ("--watchdog-s", "inf"), ("--key-fd", "-1"), ("--ready-fd", "\uff11"),
])
def test_the_producers_numbers_are_plain_ascii_decimals(places: Places, capsys: pytest.CaptureFixture[str],
                                                        option: str, value: str) -> None:
    """int() and float() take these; the producer refuses them before it starts, in one line."""
    line = refusal_line(run(capsys, "producer", "serve", "--lane", "nvfp4-native-w4a4", option, value))
    assert f"argument {option}: found" in line, line
    places.assert_nothing_written()


def test_receipts_verify_takes_several_paths_and_refuses_a_missing_one_in_one_line(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    """``receipts verify a b`` is no usage error any more (several paths); two missing ones are
    refused before any report, naming the first."""
    assert refusal_line(run(capsys, "receipts", "verify", "a", "b")) == "receipts verify: a: no such directory"
    places.assert_nothing_written()
    first, second = write_receipt(places.archive), write_receipt(places.archive)
    code, out, err = run(capsys, "receipts", "verify", str(first), str(second))
    assert (code, err, out.splitlines()[-1]) == (0, "", "2 receipts: 2 verified (2 passed)"), out


@pytest.mark.parametrize("argv", [
    ["--help"], ["--recipe", "native-text", "--help"], ["enroll", "--help"], ["calibrate", "--help"],
    ["selftest", "--help"], ["receipts", "verify", "--help"], ["identity", "check", "--help"],
], ids=" ".join)
def test_help_still_shows_the_usage_block(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    assert out.startswith("usage: qualify") and len(out.splitlines()) > 3


def test_arguments_with_control_characters_are_escaped_in_the_one_line(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal_line(run(capsys, "--recipe", "native-text", "--bogus\x1b[31m\u2028x\udcff"))
    assert "\x1b" not in line and "\\x1b" in line and "\\udcff" in line


def test_garbage_identity_file_is_refused_at_its_first_step_with_a_receipt_marked_refused(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = places.fixtures / "garbage.json"
    garbage.write_text(json.dumps({"lane": "nvfp4-native-splitk"}))
    line = refusal_line(run(capsys, "--recipe", "native-text", "--identity", str(garbage)))
    assert line.startswith(f"refused: identity sealed: identity {garbage}: "), line
    assert_one_refused_receipt(places, f"identity {garbage}: ")  # every run leaves a receipt


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("--qualify-receipts", "", "argument --qualify-receipts: found an empty path '', expected a path"),
    ("--qualify-deadline-s", "-3", "argument --qualify-deadline-s: found '-3', expected a positive number of seconds"),
])
def test_recipe_plugin_refuses_bad_options_before_any_run(option: str, value: str, expected: str, tmp_path: Path) -> None:
    """The pytest recipes take the same options (prefixed): an empty --qualify-receipts is a usage error there too."""
    import subprocess
    import sys

    from qualify.core.assets import REPO_ROOT

    done = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "qualify.recipes", "-q", "--co", f"{option}={value}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert expected in done.stderr
