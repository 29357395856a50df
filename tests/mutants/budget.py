"""The campaign budget the mutant tests and the measuring script use.

The default budget of `run_campaign` (50 examples of up to 12 steps) without the shrink phase: the
first failing example is what detection means, and shrinking it costs more than finding it.
"""

from __future__ import annotations

import hypothesis
from hypothesis import Phase

from pytest_graphmode.settings import hypothesis_settings

MAX_EXAMPLES = 50
MAX_STEPS = 12


def detection_settings(max_examples: int = MAX_EXAMPLES) -> hypothesis.settings:
    return hypothesis.settings(
        hypothesis_settings(max_examples), phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
