"""How many examples a property test draws: its full count, or a tenth of it under the mutation
gate (tools/mutation.py sets QUALIFY_MUTATION_RUN=1), where a failing example is not shrunk.

Under the gate, every mutant no test catches reruns each selected test that reaches its function,
and a fuzzer's hundreds of examples made one gate run outlast CI's 90 minutes. Examples are
derandomized, so a tenth runs the same first examples; the full counts still run in the suite.
"""

from __future__ import annotations

import os

from hypothesis import Phase, settings

MUTATION_RUN = os.environ.get("QUALIFY_MUTATION_RUN") == "1"
MUTATION_SHARE = 10


def fuzz_examples(full: int) -> int:
    """``full`` examples, or a tenth of them (at least 10) in a mutation run."""
    return max(10, full // MUTATION_SHARE) if MUTATION_RUN else full


# Property tests with no example count of their own draw hypothesis's default (100) or a tenth.
# Under the gate a failing example is found and reported as drawn: a mutant is detected by the
# failure, whatever its smallest example, and shrinking a mutant's failure (then explaining it)
# spent seconds per mutant. The suite's own runs keep every phase.
settings.register_profile(
    "mutation",
    max_examples=fuzz_examples(settings.default.max_examples),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    report_multiple_bugs=False,
)
if MUTATION_RUN:
    settings.load_profile("mutation")
