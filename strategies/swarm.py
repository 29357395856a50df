"""Swarm testing (Groce et al., "Swarm Testing", ISSTA 2012): each example switches a random subset
of the stressors, batch features and schedule shapes off.

A schedule that may use everything at every step tends to mix everything: a bug that shows only
when a feature is absent long enough (no adapters for a dozen steps, no allocator churn between two
replays, no weight update resetting a cache) is rarely drawn. With a random part of the features
switched off for a whole example, each feature still appears in about half of the examples, and
combinations that leave most of them out become common. A switched-off feature is simply never
drawn; what remains compiles to legal batches as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hypothesis import strategies as st

from pytest_graphmode.contract import TargetSpec

FEATURES = ("sampling", "adapters", "spec_decode", "weight_update")
"""The spec features a swarm may switch off: each only widens what batches and stresses hold."""
STRESSORS = ("churn", "delays", "pipelined")
"""Stressors a swarm may switch off: `delays` covers cuda sleeps and the sim's reseeded scheduler."""
SHAPES = ("admissions", "regrouping")
"""Schedule shapes a swarm may switch off. `admissions` off: requests are admitted in the first
step only, and every later step is decode-shaped (decode or speculative), the only shape many
runners replay graphs for; they run any batch with a prefill in it eagerly, and with admissions at
any step most of a schedule's steps hold one. `regrouping` off, with admissions off too: the batch
drains from its tail instead of being regrouped at every step. Every later step runs every live
request in admission order, and in about half of them the last request finishes first, so the row
it held becomes a padding row of the same graph while its blocks are free. Rows regrouped at
random rarely leave a departed request's row right behind the batch, and that is the row a runner
that does not rewrite its padding rows replays stale."""


@dataclass(frozen=True)
class Swarm:
    """What one example may use: the spec's features and the stressors left on."""

    features: frozenset[str]
    stressors: frozenset[str]
    shapes: frozenset[str] = frozenset(SHAPES)

    @property
    def drains(self) -> bool:
        """Whether this swarm's batch drains from its tail: admissions and regrouping both off."""
        return not {"admissions", "regrouping"} & self.shapes

    def spec(self, spec: TargetSpec) -> TargetSpec:
        """`spec` with the switched-off features removed: what this example's plans draw from."""
        off = frozenset(FEATURES) - self.features
        return dataclasses.replace(spec, features=spec.features - off)


EVERYTHING = Swarm(frozenset(FEATURES), frozenset(STRESSORS), frozenset(SHAPES))


@st.composite
def swarms(draw: st.DrawFn, spec: TargetSpec) -> Swarm:
    """A random subset of the features and stressors switched off (each with probability 1/2;
    those the spec lacks are not drawn). The simplest swarm switches nothing off: an example's
    first draws are unchanged, and what shrinking simplifies are the steps themselves, whose
    simplest values use no feature and no stressor anyway."""
    names = (*FEATURES, *STRESSORS, *SHAPES)
    off = {name for name in names if _offered(spec, name) and draw(st.booleans())}
    return Swarm(frozenset(FEATURES) - off, frozenset(STRESSORS) - off, frozenset(SHAPES) - off)


def _offered(spec: TargetSpec, name: str) -> bool:
    return name in STRESSORS or name in SHAPES or name in spec.features
