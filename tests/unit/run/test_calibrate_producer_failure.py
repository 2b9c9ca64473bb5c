"""A calibration whose producer fails to restart between cells is refused (exit 2, one line, its
receipt marked refused): the producer's failure, never reported as a bug in the harness (exit 70)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qualify.archive.verify import verify_receipt
from qualify.contract.lanes import lane_spec
from qualify.core.errors import ProducerFailed, Refused
from qualify.run.calibrate import calibrate
from qualify.run.qualification import QualificationRun, RunOptions
from tests.conftest import small_calibration_set

LANE = "nvfp4-native-f16"


class ProducerDiesOnRestart(QualificationRun):
    """The run as calibrate builds it, whose producer never comes back for the second cell."""

    def switch_prompt(self, prompt_name: str, prompt: np.ndarray, env: dict[str, str]) -> str:
        raise ProducerFailed("producer nvfp4-native-f16 (native): silent for 15.1 s while starting")


@pytest.mark.slow
def test_a_producer_that_does_not_restart_refuses_the_calibration(tmp_path: Path) -> None:
    archive = tmp_path / "receipts"
    options = RunOptions(recipe="native-text", receipts=archive)
    factory: Any = ProducerDiesOnRestart
    with pytest.raises(Refused, match=r"calibration handoff 2/\d+: the producer did not restart: producer "):
        calibrate(lane_spec(LANE), "native-text", options, calibration_set=small_calibration_set(tmp_path),
                  controls=False, environments=[{}], run_factory=factory)
    (receipt,) = [path for path in archive.iterdir() if path.is_dir()]
    assert verify_receipt(receipt) == []
