"""The engine protocol's conformance tests (tests/unit/engines/test_engine_conformance.py) run
against the torch engines: the compact torch Llama and transformers, both on the CPU. The tests
are bound here in their module's order (a later test may rely on what an earlier one left)."""

from __future__ import annotations

import pytest

from qualify.engines.base import Engine
from tests.unit.engines import test_engine_conformance as conformance
from tests.unit.engines.test_engine_conformance import cold, kv, pending, prompt  # noqa: F401  (its fixtures)


@pytest.fixture(scope="module", params=sorted(conformance.TORCH_ENGINES))
def engine(request: pytest.FixtureRequest) -> Engine:
    return conformance.BUILDERS[request.param]()


test_speaks_the_engine_protocol = conformance.test_speaks_the_engine_protocol
test_prefill_kv_is_canonical = conformance.test_prefill_kv_is_canonical
test_decode_output_shapes_and_greedy_choice = conformance.test_decode_output_shapes_and_greedy_choice
test_prefill_and_decode_repeat_bit_for_bit = conformance.test_prefill_and_decode_repeat_bit_for_bit
test_decode_equals_teacher_forced_on_its_own_tokens = conformance.test_decode_equals_teacher_forced_on_its_own_tokens
test_teacher_forced_rows_follow_the_forced_tokens = conformance.test_teacher_forced_rows_follow_the_forced_tokens
test_shorter_handoff_plus_pending_tokens_keeps_every_token = conformance.test_shorter_handoff_plus_pending_tokens_keeps_every_token
test_refuses_bad_tokens_and_counts = conformance.test_refuses_bad_tokens_and_counts
test_refuses_a_kv_that_does_not_fit = conformance.test_refuses_a_kv_that_does_not_fit
test_refuses_a_kv_that_drives_the_logits_non_finite = conformance.test_refuses_a_kv_that_drives_the_logits_non_finite
