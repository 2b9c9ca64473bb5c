"""The numpy EAGLE-1 draft against the training code's torch ``Draft`` on the same weights."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from qualify.core import assets
from qualify.engines.draft import EagleDraft, load_draft_safetensors
from qualify.engines.speculative import SpeculativeEngine
from tests.unit.engines import test_speculative

spec = test_speculative.spec  # its fixture, bound by assignment (see tests/torch/test_reference_engine_torch.py)

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def test_numpy_draft_matches_the_training_code(spec: SpeculativeEngine) -> None:
    """The float32 numpy draft (dense, from draft.safetensors) computes what tools/train_model.py's
    ``Draft`` computes on the same weights, to float32 rounding."""
    import torch

    sys.path.insert(0, str(assets.REPO_ROOT / "tools"))
    from safetensors.torch import load_file
    from train_model import CONFIG, Draft  # type: ignore[import-not-found]

    draft = Draft(CONFIG)
    draft.load_state_dict({k: v.float() for k, v in load_file(str(assets.MODEL_DIR / "draft.safetensors")).items()})
    rng = np.random.default_rng(5)
    embeddings = spec.target.embed(rng.integers(0, 4096, size=64))
    hidden = (rng.standard_normal((64, 256)) * 0.9).astype(np.float32)
    with torch.no_grad():
        expected = draft(torch.from_numpy(embeddings)[None], torch.from_numpy(hidden)[None])[0].numpy()
    weights = load_draft_safetensors(assets.MODEL_DIR / "draft.safetensors", spec.geometry, 512)
    numpy_draft = EagleDraft(weights, spec.geometry, 1e-5, spec.target.reference.rope)
    predicted, _, _ = numpy_draft.layer.prefill(numpy_draft.layer_inputs(embeddings, hidden))
    np.testing.assert_allclose(predicted, expected, atol=2e-5 * float(np.abs(expected).max()))
