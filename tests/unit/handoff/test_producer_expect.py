"""``qualify producer expect``: the ``--expect`` document of a remote producer, derived as a run
derives its contract; a producer of the lane starts on it, and every refusal is one line, exit 2,
with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualify.contract.identity import identity_sha256, load_identity
from qualify.contract.lanes import lane_spec
from qualify.core.assets import REPO_ROOT
from qualify.handoff.protocol import ProducerExpectation
from qualify.interfaces import cli
from qualify.run.run_contract import chosen_lane, identity_path_for_lane

RECIPE = "native-text"


def expect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["producer", "expect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_document_starts_the_lanes_producer_and_names_the_runs_identity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qualify.engines.factory import build_producer
    from qualify.handoff.service import check_engine

    out = tmp_path / "expect.json"
    code, stdout, stderr = expect(capsys, "--recipe", RECIPE, "--out", str(out))
    assert code == 0, stderr
    lane = chosen_lane(RECIPE, "reference", "reference")  # what `qualify --recipe native-text` runs
    mode = lane.mode.value
    document = json.loads(out.read_text(encoding="utf-8"))
    expectation = ProducerExpectation.from_document(document)
    assert expectation.identity_sha256 == identity_sha256(load_identity(identity_path_for_lane(lane.name)))
    # The producer's own start-time check accepts the lane's engine against it.
    check_engine(build_producer(lane.name, lane.mode), mode=lane.mode, expectation=expectation)
    assert f"lane {lane.name}, mode {mode}" in stdout
    assert f"qualify producer serve --lane {lane.name} --mode {mode} --expect {out}" in stdout
    assert out.stat().st_mode & 0o777 == 0o644


def test_another_lanes_producer_is_refused_by_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The document pins the run's lane: the exact anchor's engine (same model) does not start on it."""
    from qualify.engines.factory import build_producer
    from qualify.handoff.protocol import StartRefused
    from qualify.handoff.service import check_engine

    out = tmp_path / "expect.json"
    assert expect(capsys, "--recipe", RECIPE, "--lane", "nvfp4-native-splitk", "--out", str(out))[0] == 0
    expectation = ProducerExpectation.from_document(json.loads(out.read_text(encoding="utf-8")))
    other = lane_spec("nvfp4-native-w4a4")
    with pytest.raises(StartRefused, match="engine abi: found"):
        check_engine(build_producer(other.name, other.mode), mode=other.mode, expectation=expectation)


@pytest.mark.parametrize(("argv", "cause"), [
    (("--lane", "kquant-exact-dflash"), "recipe: found kquant-target-plus-dflash, the run is --recipe native-text"),
    (("--lane", "nvfp4-exact"), "--lane nvfp4-exact: its identity"),
    (("--lane", "no-such-lane"), "argument --lane: invalid choice: 'no-such-lane'"),
    (("--identity", "{tmp}/missing.json"), "--identity '{tmp}/missing.json': no such file"),
    (("--identity", "{contracts}/nvfp4-native-splitk-identity-v1.json", "--lane", "nvfp4-native-splitk"),
     "argument --lane: not allowed with argument --identity"),
    (("--model", "{tmp}/no-model"), "no-model"),
], ids=["other-recipe", "no-identity", "unknown-lane", "missing-identity", "identity-and-lane", "no-model"])
def test_refusals_are_one_line_exit_2_and_leave_the_file_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               argv: tuple[str, ...], cause: str) -> None:
    out = tmp_path / "expect.json"
    out.write_text("earlier\n", encoding="utf-8")
    fill = {"tmp": str(tmp_path), "contracts": str(REPO_ROOT / "contracts")}
    code, stdout, stderr = expect(capsys, "--recipe", RECIPE, *(arg.format(**fill) for arg in argv), "--out", str(out))
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and cause.format(**fill) in stderr, stderr
    assert stdout == "" and "Traceback" not in stderr
    assert out.read_text(encoding="utf-8") == "earlier\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["expect.json"]  # no temporary left


@pytest.mark.parametrize(("out", "cause"), [("{tmp}", "is a directory or other non-regular file"),
                                            ("{tmp}/no-dir/expect.json", "cannot write there")],
                         ids=["a-directory", "no-directory"])
def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 out: str, cause: str) -> None:
    code, _, stderr = expect(capsys, "--recipe", RECIPE, "--out", out.format(tmp=tmp_path))
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and cause in stderr, stderr
    assert list(tmp_path.iterdir()) == []
