"""Bad options are refused before any step starts: exit 2, one line on stderr, nothing on stdout,
no receipt; a run refused at its first step lists the steps it did not run on one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from qualify.archive.keys import ensure_signing_key, init_key
from qualify.interfaces import cli
from qualify.run.qualification import STEP_LABELS, QualificationRun
from tests.conftest import isolate_cli_environment


class Places(NamedTuple):
    root: Path
    archive: Path
    file: Path
    directory: Path


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Places]:
    """An isolated archive, a regular file and a directory to point options at; any step that
    starts fails the test (nothing may run before the refusal)."""
    archive, data, cwd = tmp_path / "archive", tmp_path / "data", tmp_path / "cwd"
    for directory in (archive, data, cwd):
        directory.mkdir()
    isolate_cli_environment(monkeypatch, cwd=cwd, archive=archive, data=data)
    init_key()

    def no_step(self: QualificationRun, label: str) -> None:
        raise AssertionError(f"step {label!r} started for a refused argument")

    monkeypatch.setattr(QualificationRun, "step", no_step)
    file = tmp_path / "a-file"
    file.write_text("not a directory\n")
    yield Places(tmp_path, archive, file, tmp_path / "data")


RECIPE = ["--recipe", "native-text"]
CALIBRATE = ["calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16"]

BAD_OPTIONS: list[tuple[list[str], str]] = [
    ([*RECIPE, "--fault", "nosuch"], "refused: fault: unknown name 'nosuch'; expected one of "),
    ([*RECIPE, "--producer", "nope"], "qualify: error: argument --producer: invalid choice: 'nope'"),
    ([*RECIPE, "--consumer", "nope"], "qualify: error: argument --consumer: invalid choice: 'nope'"),
    (["--recipe", "nosuch"], "qualify: error: argument --recipe: invalid choice: 'nosuch'"),
    (["--recipe", "kquant-target-plus-dflash", "--producer", "vllm"],
     "refused: --producer vllm --consumer reference: vLLM lanes qualify under --recipe native-text"),
    ([*RECIPE, "--identity", "MISSING"], "refused: --identity 'MISSING': no such file, expected a regular file"),
    ([*RECIPE, "--identity", "DIRECTORY"], "refused: --identity 'DIRECTORY': is a directory"),
    ([*RECIPE, "--receipts", "FILE"], "refused: --receipts 'FILE': is a file or other non-directory"),
    ([*RECIPE, "--deadline-s", "0"], "qualify: error: argument --deadline-s: found '0', expected a positive"),
    ([*RECIPE, "--reference-twice"], "qualify: error: unrecognized arguments: --reference-twice"),
    ([*RECIPE, "--json=yes"], "qualify: error: argument --json: ignored explicit argument 'yes'"),
    ([*CALIBRATE, "--anchors", "1"], "qualify calibrate: error: argument --anchors: found '1'"),
    (["calibrate", "--recipe", "kquant-target-plus-dflash", "--lane", "nvfp4-native-f16"],
     "refused: calibrate --lane nvfp4-native-f16: its recipe is native-text"),
    ([*CALIBRATE, "--receipts", "FILE"], "refused: --receipts 'FILE': is a file or other non-directory"),
    ([*CALIBRATE, "--non-deterministic", "--anchors", "3"], "refused: --anchors: "),
    ([*CALIBRATE, "--envelope-handoffs", "8"], "refused: --envelope-handoffs: "),
    ([*CALIBRATE, "--envelope-starts", "2"], "refused: --envelope-starts: "),
    ([*CALIBRATE, "--non-deterministic", "--envelope-handoffs", "3"], "refused: --envelope-handoffs: found 3"),
    ([*CALIBRATE, "--non-deterministic", "--envelope-starts", "5"], "refused: --envelope-starts: found 5"),
    ([*CALIBRATE, "--non-deterministic", "--envelope-starts", "1"], "refused: --envelope-starts: found 1"),
    ([*CALIBRATE, "--non-deterministic", "--envelope-handoffs", "x8"],
     "qualify calibrate: error: argument --envelope-handoffs: found 'x8'"),
    (["calibrate", "--recipe", "kquant-target-plus-dflash", "--lane", "kquant-exact-dflash", "--non-deterministic"],
     "refused: --non-deterministic: lane kquant-exact-dflash is rung 3"),
    (["selftest", "--fault", "kv-ulp", "--fault", "nosuch"], "refused: selftest --fault: found 'nosuch'"),
    (["selftest", "--receipts", "FILE"], "refused: --receipts 'FILE': is a file or other non-directory"),
    (["receipts", "verify", "MISSING"], "receipts verify: MISSING: no such directory"),
    (["identity", "check", "MISSING"], "refused: identity MISSING: "),
]


def concrete(argv: list[str], places: Places) -> list[str]:
    named = {"MISSING": str(places.root / "missing.json"), "DIRECTORY": str(places.directory),
             "FILE": str(places.file)}
    return [named.get(word, word) for word in argv]


def expected_line(start: str, places: Places) -> str:
    for word, path in (("MISSING", places.root / "missing.json"), ("DIRECTORY", places.directory),
                       ("FILE", places.file)):
        start = start.replace(word, str(path))
    return start


@pytest.mark.parametrize(("argv", "start"), BAD_OPTIONS, ids=lambda value: " ".join(value) if isinstance(value, list)
                         else "")
def test_a_bad_option_is_refused_before_any_step_in_one_stderr_line(
    places: Places, capsys: pytest.CaptureFixture[str], argv: list[str], start: str
) -> None:
    code = cli.main(concrete(argv, places))
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""  # nothing on stdout for a refused argument
    assert err.count("\n") == 1 and err.startswith(expected_line(start, places)), err
    assert "Traceback" not in err and "internal error" not in err
    assert list(places.archive.iterdir()) == []  # no run, so no receipt


def test_an_identity_refused_at_its_first_step_lists_the_steps_not_run_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # pytest-xdist's workers say 80: the one line would wrap
    ensure_signing_key(announce=lambda line: None)  # a first run's "made signing key" line is not the refusal
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({"lane": "nvfp4-native-splitk"}))
    code = cli.main([*RECIPE, "--identity", str(identity), "--receipts", str(tmp_path / "archive")])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"refused: identity sealed: identity {identity}: "), err
    (receipt,) = (tmp_path / "archive").iterdir()
    lines = out.splitlines()
    assert lines[0] == "qualify --recipe native-text" and lines[1].startswith(" ✗ identity sealed")
    not_run = [line for line in lines if "not run" in line]
    assert not_run == [" · not run (blocked: step 'identity sealed' failed): " + ", ".join(STEP_LABELS[1:])], out
    assert "blocked" not in "".join(line for line in lines if "not run" not in line)
    assert lines[-1] == f"receipt: {receipt} (refused)"


def test_producer_serve_help_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["producer", "serve", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: qualify producer serve ")
