"""Recipe native-text (rung 2): three ordered 2048/256 exact-token handoffs whose full-logit drift
must sit inside the bounds written in the frozen identity, each checked against a cold local
recompute on the consumer.

Run: ``pytest recipes/native_text.py`` (options: --identity, --producer, --reference-once,
--fault, --receipts). ``qualify --recipe native-text`` drives the same steps in-process.
"""

import pytest

from qualify.interfaces.plugin import run_recipe_step
from qualify.run.qualification import STEP_LABELS

RECIPE = "native-text"
pytestmark = pytest.mark.recipe(RECIPE)


@pytest.mark.parametrize("label", STEP_LABELS)
def test_step(qualification, label, record_property):
    """One progress label; parametrized in order, so the run's steps execute in sequence.
    ``record_property`` carries the step's numbers and the run's verdict into the JUnit XML."""
    run_recipe_step(qualification, label, record_property)
