"""`replay`: re-run a concrete schedule (a failure's snippet) with every check."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, TargetFactory, batch_problems
from pytest_graphmode.failure import GraphmodeFailure
from pytest_graphmode.fuzz.lockstep import Lockstep
from pytest_graphmode.strategies.plans import Reset, Stress


def replay(
    batches: Sequence[Batch | Stress | Reset],
    *,
    factory: TargetFactory,
    backend: str = "sim",
    seed: int = 0,
) -> CampaignStats:
    """Run `batches` (optionally interleaved with `Stress` events, which apply before the next
    batch, and `Reset` events, which start the next example on the same twins) through the twins
    with every check; raise `GraphmodeFailure` like a campaign.

    `seed` is the targets' seed, the poisoning seed and the seed of torch's global generator: use
    the one a failure reports.
    Illegal batches are refused with the reasons before any step runs.
    """
    resets = sum(isinstance(event, Reset) for event in batches)
    stats = CampaignStats(examples=1 + resets)
    started = time.perf_counter()
    lockstep = Lockstep(factory, backend=backend, seed=seed, stats=stats, kept=resets > 0)
    try:
        problems = [
            f"batch {i}: {problem}"
            for i, batch in enumerate(e for e in batches if isinstance(e, Batch))
            for problem in batch_problems(batch, lockstep.spec)
        ]
        if problems:
            raise ValueError("illegal schedule, nothing was run:\n" + "\n".join(problems))
        lockstep.run(batches)
    except GraphmodeFailure as failed:
        stats.failures.append(failed.failure)
        raise
    finally:
        lockstep.close()
        stats.seconds = time.perf_counter() - started
    return stats
