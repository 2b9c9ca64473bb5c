"""Recipe native-text (rung 2): three ordered 2048/256 exact-token handoffs whose full-logit drift
must sit inside the bounds written in the frozen identity, each checked against a cold local
recompute on the consumer.

Run: ``python -m pytest --pyargs qualify.recipes.native_text`` (options: --qualify-identity,
--qualify-producer, --qualify-reference-once, --qualify-fault, --qualify-receipts).
``qualify --recipe native-text`` drives the same steps in-process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from qualify.interfaces.plugin import run_recipe_step
from qualify.run.qualification import STEP_LABELS

if TYPE_CHECKING:
    from qualify.run.qualification import QualificationRun

RECIPE = "native-text"
pytestmark = pytest.mark.recipe(RECIPE)


@pytest.mark.parametrize("label", STEP_LABELS)
def test_step(qualification: QualificationRun, label: str, request: pytest.FixtureRequest) -> None:
    """One progress label; parametrized in order, so the run's steps execute in sequence. The
    step's numbers and the run's verdict go into the test's JUnit XML properties."""
    run_recipe_step(qualification, label, request.node)
