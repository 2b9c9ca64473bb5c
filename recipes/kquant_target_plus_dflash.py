"""Recipe kquant-target-plus-dflash (rung 3): three ordered 2048/256 handoffs that must be
bit-exact: target tokens, full logits, draft tokens and trace, with draft acceptance at or above
the sealed floor.

Run: ``pytest recipes/kquant_target_plus_dflash.py`` (options: --identity, --reference-once,
--drift-graded, --fault, --receipts). ``qualify --recipe kquant-target-plus-dflash`` drives the
same steps in-process.
"""

import pytest

from qualify.interfaces.plugin import run_recipe_step
from qualify.run.qualification import STEP_LABELS

RECIPE = "kquant-target-plus-dflash"
pytestmark = pytest.mark.recipe(RECIPE)


@pytest.mark.parametrize("label", STEP_LABELS)
def test_step(qualification, label, record_property):
    """One progress label; parametrized in order, so the run's steps execute in sequence.
    ``record_property`` carries the step's numbers and the run's verdict into the JUnit XML."""
    run_recipe_step(qualification, label, record_property)
