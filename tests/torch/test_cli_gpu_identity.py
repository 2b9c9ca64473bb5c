"""A GPU lane's identity on a machine with torch but no CUDA device: refused at 'identity sealed' in one line."""

from __future__ import annotations

import pytest

from tests.unit.interfaces import test_cli_hostile
from tests.unit.interfaces.test_cli_hostile import (
    GPU_IDENTITY,
    Places,
    _cuda_available,
    assert_one_refused_receipt,
    refusal_line,
    run,
)

places = test_cli_hostile.places  # its fixture


@pytest.mark.skipif(_cuda_available(), reason="this host has a CUDA device: the GPU lane can run here")
def test_gpu_identity_on_a_cpu_machine_exits_2_with_one_line(
    places: Places, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused at 'identity sealed' once the identity has loaded: one line, exit 2, and a
    receipt marked refused in the archive (and nothing anywhere else)."""
    line = refusal_line(run(capsys, "--recipe", "native-text", "--identity", str(GPU_IDENTITY)))
    assert line.startswith("refused: identity sealed: ") and "no CUDA device" in line, line
    assert_one_refused_receipt(places, "no CUDA device")
