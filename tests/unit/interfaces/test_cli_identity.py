"""The ``qualify`` console script: identity check, exit codes, delegated commands, no tracebacks."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from qualify.contract import identity as identity_module
from qualify.contract import sealed_data
from qualify.contract.identity import identity_sha256, load_identity
from qualify.core.digests import document_sha256
from qualify.interfaces import cli
from tests.unit.contract.test_identity import BASIS_RUN_ID, make_pair, writable

REPO = Path(__file__).resolve().parents[3]


def run_qualify(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "QUALIFY_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "qualify.interfaces.cli", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=environment,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str] | tuple[int, str, str]) -> str:
    code, out, err = (result.returncode, result.stdout, result.stderr) if not isinstance(result, tuple) else result
    assert code == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_help_shows_every_command() -> None:
    result = run_qualify("--help")
    assert result.returncode == 0
    for word in ("--recipe", "identity", "receipts", "enroll", "calibrate", "selftest", "producer"):
        assert word in result.stdout
    assert " ".join(cli.EXIT_CODES.split()) in " ".join(result.stdout.split())  # the exit codes, every one stated


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("not-json.json", b"lane: nvfp4-native-splitk\n", "not JSON"),
        ("empty.json", b"", "not JSON"),
        ("utf16.json", json.dumps({"lane": "nvfp4-native-splitk"}).encode("utf-16"), "not UTF-8"),
        ("latin1.json", '{"lane": "nvfp4-native-splitk", "x": "d\u00e9j\u00e0"}'.encode("latin-1"), "not UTF-8"),
        ("nested.json", 10 * 1024 * 1024, "expected at most 1048576"),
        ("nested-small.json", 500_000, "nesting deeper than 32"),
        ("nan.json", b'{"a": NaN}', "expected a finite number"),
        ("array.json", b"[1, 2]", "expected type object"),
    ],
    ids=lambda value: value if isinstance(value, str) and value.endswith(".json") else "",
)
def test_malformed_files_give_one_line_and_exit_2(
    tmp_path: Path, name: str, content: bytes | int, fragment: str
) -> None:
    """``content`` is the file's bytes, or a count of '[' (kept out of the test id)."""
    path = tmp_path / name
    path.write_bytes(b"[" * content if isinstance(content, int) else content)
    line = one_line_refusal(run_qualify("identity", "check", str(path)))
    assert str(path) in line and fragment in line


def test_directory_and_missing_file_give_one_line(tmp_path: Path) -> None:
    assert "is a directory" in one_line_refusal(run_qualify("identity", "check", str(tmp_path)))
    missing = tmp_path / "absent.json"
    assert f"identity {missing}: no such file" in one_line_refusal(run_qualify("identity", "check", str(missing)))


def test_console_script_is_installed_and_refuses_cleanly(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("qualify")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable} (package not installed)")
    result = subprocess.run([str(script), "identity", "check", str(tmp_path / "x.json")],
                            capture_output=True, text=True, timeout=120)
    assert "no such file" in one_line_refusal(result)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def sealed_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A synthetic identity whose lane is sealed for this test only (the shipped table is untouched);
    its basis passes the manifest seal but holds no calibration samples or evidence."""
    pair = make_pair(tmp_path)
    monkeypatch.setattr(sealed_data, "SEALED_IDENTITIES", pair.table)
    monkeypatch.setattr(sealed_data, "SEALED_BASIS_MANIFESTS", pair.bases)
    monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", pair.archive)
    return pair


SHIPPED_LANE = "nvfp4-native-splitk"


@pytest.fixture
def shipped_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of a shipped identity, its basis resolved in a scratch archive holding a copy of the
    committed basis receipt (samples, calibration evidence, controls): a basis the full check
    (seal, re-derived bounds, anchors, controls) accepts, with ``receipts/`` never touched."""
    shipped = REPO / "contracts" / f"{SHIPPED_LANE}-identity-v1.json"
    run_id = load_identity(shipped).onboarding_qualification.basis.removeprefix("receipt://").partition("/")[0]
    archive = tmp_path / "archive"
    shutil.copytree(REPO / "receipts" / run_id, archive / run_id)
    monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", archive)
    copy = tmp_path / shipped.name
    shutil.copyfile(shipped, copy)
    return copy


def test_valid_identity_exits_0_with_lane_and_digest(shipped_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys, "identity", "check", str(shipped_copy))
    assert code == 0, err
    digest = identity_sha256(load_identity(shipped_copy))
    assert digest == sealed_data.SEALED_IDENTITIES[SHIPPED_LANE]
    assert f"identity {shipped_copy}: valid: lane {SHIPPED_LANE} " in out and f"identity_sha256 {digest}" in out
    assert len(out.strip().splitlines()) == 1 and err == ""


def test_a_sealed_identity_whose_basis_holds_no_calibration_is_refused(sealed_pair, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """The synthetic pair's basis passes its manifest seal but records no sample to re-derive the
    bounds from or recheck a run against: absent evidence is refused, naming the basis receipt."""
    line = one_line_refusal(_main(capsys, "identity", "check", str(sealed_pair.path)))
    assert f"basis receipt {BASIS_RUN_ID}: no samples/sample-*.json to recheck against" in line


def test_relaxed_bound_exits_2_naming_lane_and_digests(sealed_pair, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    document = json.loads(sealed_pair.path.read_text())
    document["onboarding_qualification"]["full_logits"]["maximum_absolute"] = 12.0
    sealed_pair.path.write_text(json.dumps(document))
    line = one_line_refusal(_main(capsys, "identity", "check", str(sealed_pair.path)))
    assert (f"identity {sealed_pair.path}: lane nvfp4-native-splitk: identity sha256 found "
            f"{document_sha256(document)}, sealed {sealed_pair.sealed_sha256}") in line
    assert "tools/freeze_identity.py" in line


def test_identity_check_verifies_the_basis_receipt(sealed_pair, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    basis = writable(sealed_pair.archive / BASIS_RUN_ID / "command.log")
    basis.write_bytes(basis.read_bytes() + b"edited\n")
    line = one_line_refusal(_main(capsys, "identity", "check", str(sealed_pair.path)))
    assert f"identity {sealed_pair.path}: onboarding_qualification.basis: " in line


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["identity"],
        ["identity", "check"],
        ["identity", "check", "a.json", "b.json"],
        ["identity", "verify", "a.json"],
        ["bogus"],
        ["--recipe"],
        ["--recipe", "fast-and-loose"],
        ["receipts"],
        ["producer"],
        ["--no-such-option"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys, *argv)
    assert code == 2
    assert "Traceback" not in err


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **functions: object) -> None:
    module = types.ModuleType(name)
    for attribute, value in functions.items():
        setattr(module, attribute, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_delegated_commands_receive_their_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, object]] = []
    _fake_module(monkeypatch, "qualify.interfaces.enroll_command", enroll_cli=lambda argv: calls.append(("enroll", argv)) or 0)
    _fake_module(
        monkeypatch, "qualify.interfaces.console",
        run_cli=lambda argv: calls.append(("run", argv)) or 1,
        calibrate_cli=lambda argv: calls.append(("calibrate", argv)) or 0,
        selftest_cli=lambda argv: calls.append(("selftest", argv)) or 0,
    )
    _fake_module(monkeypatch, "qualify.interfaces.verify_command", verify_cli=lambda argv: calls.append(("verify", argv)) or 0)
    _fake_module(monkeypatch, "qualify.interfaces.producer_command",
                 producer_serve_cli=lambda argv: calls.append(("serve", argv)) or 75)

    assert _main(capsys, "enroll", "--identity", "id.json", "--receipt", "r")[0] == 0
    assert _main(capsys, "--recipe", "native-text", "--identity", "id.json", "--drift-graded")[0] == 1
    assert _main(capsys, "--identity", "id.json", "--recipe=native-text")[0] == 1
    assert _main(capsys, "calibrate", "--lane", "nvfp4-native-f16")[0] == 0
    assert _main(capsys, "selftest")[0] == 0
    assert _main(capsys, "receipts", "verify", "receipts/run-1")[0] == 0
    assert _main(capsys, "receipts", "verify")[0] == 0
    assert _main(capsys, "receipts", "verify", "a", "b")[0] == 0
    assert _main(capsys, "receipts", "verify", "--trust", "t.json", "r")[0] == 0
    assert _main(capsys, "producer", "serve", "--lane", "nvfp4-exact")[0] == 75
    assert calls == [
        ("enroll", ["--identity", "id.json", "--receipt", "r"]),
        ("run", ["--recipe", "native-text", "--identity", "id.json", "--drift-graded"]),
        ("run", ["--identity", "id.json", "--recipe=native-text"]),
        ("calibrate", ["--lane", "nvfp4-native-f16"]),
        ("selftest", []),
        ("verify", ["receipts/run-1"]),
        ("verify", []),
        ("verify", ["a", "b"]),
        ("verify", ["--trust", "t.json", "r"]),
        ("serve", ["--lane", "nvfp4-exact"]),
    ]


@pytest.mark.parametrize("delegate", cli.DELEGATES + (cli.RECIPE_DELEGATE,), ids=lambda d: " ".join(d.words))
def test_missing_delegates_are_not_available(
    delegate: cli.Delegate, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The module each loader imports, read from the loader's own source (no second table to drift).
    module = re.search(r"from (qualify[.\w]+) import", inspect.getsource(delegate.load)).group(1)
    monkeypatch.setitem(sys.modules, module, None)  # import now fails
    argv = ["--recipe", "native-text"] if delegate is cli.RECIPE_DELEGATE else list(delegate.words)
    line = one_line_refusal(_main(capsys, *argv))
    assert "not available" in line and module in line


def test_delegate_returning_a_non_exit_code_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_module(monkeypatch, "qualify.interfaces.enroll_command", enroll_cli=lambda argv: None)
    assert "expected an exit code" in one_line_refusal(_main(capsys, "enroll"))


def test_unexpected_errors_are_one_line_unless_debugging(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def explode(path: object) -> None:
        raise ZeroDivisionError("boom\nsecond line")

    monkeypatch.setattr(identity_module, "load_identity", explode)
    monkeypatch.delenv("QUALIFY_DEBUG", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    code, out, err = _main(capsys, "identity", "check", str(tmp_path))
    (line,) = err.splitlines()  # one line, exit 70: a bug in the harness, not a refusal (2)
    assert code == 70 and out == "" and "Traceback" not in err
    assert line.startswith("qualify: internal error (a bug in the harness): ZeroDivisionError: boom second line; "
                           f"traceback: {tmp_path / 'state'}")
    monkeypatch.setenv("QUALIFY_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["identity", "check", str(tmp_path)])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(capsys, "--version")
    assert code == 0 and out.startswith("qualify ")
