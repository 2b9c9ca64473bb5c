"""The engine factory's torch-llama lanes: the KV dtype of a lane is its model file's."""

from __future__ import annotations

import pytest

from qualify.contract.lanes import lane_spec
from qualify.core import assets
from qualify.core.errors import Refused


def test_the_kv_dtype_of_a_lane_is_its_models(tmp_path) -> None:
    """A torch-llama lane hands off KV in its model file's dtype; every other lane in float32;
    a model file with another field set is refused, naming the file."""
    import json

    from qualify.contract.lanes import LLAMA3_8B_SHAPE_LANE, TORCH_LLAMA_MODELS
    from qualify.engines.factory import lane_kv_dtype
    from qualify.engines.torch_llama import random_model

    model_file = assets.REPO_ROOT / TORCH_LLAMA_MODELS[LLAMA3_8B_SHAPE_LANE]
    assert lane_kv_dtype(lane_spec(LLAMA3_8B_SHAPE_LANE)) == json.loads(model_file.read_text())["dtype"]
    assert lane_kv_dtype(lane_spec("nvfp4-native-w4a4")) == "float32"
    document = json.loads(model_file.read_text())
    document["extra"] = 1
    (tmp_path / "config.json").write_text(json.dumps(document))
    with pytest.raises(Refused, match=r"random model .*config.json: fields"):
        random_model(tmp_path / "config.json")
