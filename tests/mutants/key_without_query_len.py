"""Class 5, incomplete graph key: graphs are chosen by request count alone, so a speculative-decode
batch (1 + k query tokens per request) replays the plain decode graph of its size.

Mirrors graph keys that hold the padded batch size but not the uniform query length: the decode
graph computes one token per request, so the draft tokens are neither scored nor written to the KV
cache, and the logits belong to the wrong position.
"""

from __future__ import annotations

from typing import Literal

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 5
EXPECTED_CHECK = "replay_matches_eager"
# The draft tokens' keys and values are never written: named first when the draft's own slot is
# judged before any logits.
ALSO_SEEN_BY = ("kv_writes_land",)


class KeyWithoutQueryLen(minimal.MinimalRunner):
    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "graph" and batch.phase == "decode":
            fits = batch.num_reqs <= minimal.SPEC.capture_sizes[-1]
            return None if fits else "more requests than the largest capture size"
        return super().fallback_reason(batch)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> KeyWithoutQueryLen:
    return KeyWithoutQueryLen(mode, seed=seed, backend=backend)
