"""Recipe kquant-target-plus-dflash (rung 3): three ordered 2048/256 handoffs that must be
bit-exact: target tokens, full logits, draft tokens and trace, with draft acceptance at or above
the sealed floor.

Run: ``python -m pytest --pyargs qualify.recipes.kquant_target_plus_dflash`` (options:
--qualify-identity, --qualify-reference-once, --qualify-drift-graded, --qualify-fault,
--qualify-receipts). ``qualify --recipe kquant-target-plus-dflash`` drives the same steps in-process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from qualify.interfaces.plugin import run_recipe_step
from qualify.run.qualification import STEP_LABELS

if TYPE_CHECKING:
    from qualify.run.qualification import QualificationRun

RECIPE = "kquant-target-plus-dflash"
pytestmark = pytest.mark.recipe(RECIPE)


@pytest.mark.parametrize("label", STEP_LABELS)
def test_step(qualification: QualificationRun, label: str, request: pytest.FixtureRequest) -> None:
    """One progress label; parametrized in order, so the run's steps execute in sequence. The
    step's numbers and the run's verdict go into the test's JUnit XML properties."""
    run_recipe_step(qualification, label, request.node)
