"""The lockstep driver: runs one schedule through four twins of a target and checks every step.

Twins, all made by the same factory with the same seed (hence the same weights and state):
- `graph`: graph mode, poisoned before every step (static buffers, null block), stressed;
- `eager`: eager mode, the reference; its null block is poisoned too;
- `clean`: graph mode, never poisoned; `padding_inert` demands bit-identical valid rows;
- `company`: eager mode, never poisoned, runs only the sampled requests (see `sampling_check.py`);
  made only for targets with the "sampling" feature.
Only the two graph twins capture graphs: capture dominates the cost of an example.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, GraphTarget, StepResult, TargetFactory, TargetSpec
from pytest_graphmode.failure import Failure, GraphmodeFailure
from pytest_graphmode.fuzz import sampling_check
from pytest_graphmode.fuzz.checks import Outcome
from pytest_graphmode.fuzz.registry import REGISTRY, Evidence, Kept, State
from pytest_graphmode.fuzz.snippet import replay_snippet
from pytest_graphmode.fuzz.violation import Violation
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.strategies import stressors
from pytest_graphmode.strategies.plans import Stress


def bucket_for(spec: TargetSpec, num_tokens: int) -> int:
    """The capture size a padded graph would use for `num_tokens`; 0 above the largest."""
    return next((size for size in spec.capture_sizes if size >= num_tokens), 0)


def snapshot(state: Mapping[str, torch.Tensor]) -> State:
    """A CPU copy of a twin's `state()`, to compare with the state after a step."""
    return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}


def step_outcome(target: GraphTarget, batch: Batch) -> Outcome:
    """`target.step(batch)`, or the traceback of what it raised."""
    try:
        return Outcome(target.step(batch))
    except Exception:  # a runner's failure is a finding, reported with its traceback
        return Outcome(None, traceback.format_exc())


class Lockstep:
    """Owns the twins of one example; `run` raises `GraphmodeFailure` on the first violation."""

    def __init__(
        self, factory: TargetFactory, *, backend: str, seed: int, stats: CampaignStats
    ) -> None:
        from pytest_graphmode.runtime import backends

        # A runner that draws from torch's global generator (knowingly or not) must give the
        # same values in a campaign and in the replay of its snippet: both start here, from the
        # example's seed, before any target is made.
        torch.manual_seed(seed)
        self.backend: Backend = backends.get(backend)
        self.backend.set_scheduler_seed(seed)
        self.backend.activate()  # for the twins' life: close() deactivates
        self.backend.take_races()  # found before this example: not its races
        self._activated = True
        self._factory, self._backend_name, self.seed, self.stats = factory, backend, seed, stats
        self._targets: list[GraphTarget] = []
        try:
            self.graph = self._make("graph")
            self.eager = self._make("eager")
            self.clean = self._make("graph")
            self.spec = self.graph.spec
            self.company = self._make("eager") if "sampling" in self.spec.features else None
        except BaseException:
            self.close()
            raise
        for twin in self._targets:
            if twin.spec != self.spec:
                self.close()
                raise ValueError(
                    f"the factory made twins with different specs: {twin.spec} vs "
                    f"{self.spec}; a factory must be deterministic in its seed"
                )

    def _make(self, mode: Literal["graph", "eager"]) -> GraphTarget:
        target = self._factory(mode, seed=self.seed, backend=self._backend_name)
        self._targets.append(target)
        return target

    def close(self) -> None:
        for target in self._targets:
            target.close()
        self._targets.clear()
        if self._activated:
            self._activated = False
            self.backend.deactivate()

    def run(self, events: Sequence[Batch | Stress]) -> None:
        kept: list[Kept] = []
        pending = Stress()
        previous: Batch | None = None
        step = 0
        for index, event in enumerate(events):
            if isinstance(event, Stress):
                pending = event
                continue
            rng = random.Random(self.seed * 1_000_003 + step)
            held = self._stress(pending, previous, event, rng)
            pending = Stress()
            violations, kept = self._check_step(step, event, kept)
            held.clear()  # churned tensors live exactly across the step
            if violations:
                self._fail(violations[0], step, event, events[: index + 1])
            previous = event
            step += 1

    def _stress(
        self, stress: Stress, previous: Batch | None, batch: Batch, rng: random.Random
    ) -> list[torch.Tensor]:
        if stress.weight_seed is not None:
            for twin in self._targets:
                twin.update_weights(stress.weight_seed)
        blocks, slots = stressors.live_indices(self.spec, [b for b in (previous, batch) if b])
        stressors.poison_static_buffers(
            self.graph.static_buffers(), live_blocks=blocks, live_slots=slots, rng=rng
        )
        stressors.poison_null_block(self.graph.state(), self.spec)
        stressors.poison_null_block(self.eager.state(), self.spec)
        kept = stressors.churn(self.backend.device, stress.churn, rng)
        stressors.delay(self.backend, stress)
        return kept

    def _check_step(
        self, step: int, batch: Batch, kept: list[Kept]
    ) -> tuple[list[Violation], list[Kept]]:
        graph_before, eager_before = snapshot(self.graph.state()), snapshot(self.eager.state())
        graph, eager = step_outcome(self.graph, batch), step_outcome(self.eager, batch)
        clean = step_outcome(self.clean, batch)
        sub = sampling_check.company_batch(batch) if self.company else None
        company = step_outcome(self.company, sub) if self.company and sub else None
        self._count(batch, graph.result)
        now = [
            (r, (r.logits.detach().cpu().clone(), r.next_tokens.cpu().clone()), step)
            for r in (graph.result, eager.result)
            if r is not None
        ]
        raised = bool(graph.error or eager.error)
        evidence = Evidence(
            batch=batch,
            spec=self.spec,
            graph=graph,
            eager=eager,
            clean=clean,
            graph_before=graph_before,
            eager_before=eager_before,
            graph_after={} if raised else snapshot(self.graph.state()),
            eager_after={} if raised else snapshot(self.eager.state()),
            clean_after={} if raised else snapshot(self.clean.state()),
            views=[] if raised else self.graph.address_views(),
            kept=kept,
            company_batch=sub,
            company=company,
            races=self.backend.take_races(),
        )
        for check in REGISTRY:
            if (raised and not check.judges_raising_twins) or not check.applies(evidence):
                continue
            self.stats.checks_run[check.name] += 1
            found = check.judge(evidence)
            if found:
                return found, now
        return [], now

    def _count(self, batch: Batch, result: StepResult | None) -> None:
        self.stats.steps += 1
        self.stats.buckets_hit[bucket_for(self.spec, batch.num_tokens)] += 1
        if result is not None:
            self.stats.paths[result.path] += 1
            if result.path != "full" and result.reason:
                self.stats.fallback_reasons[result.reason] += 1

    def _fail(
        self, violation: Violation, step: int, batch: Batch, events: Sequence[Batch | Stress]
    ) -> None:
        snippet = replay_snippet(
            events, factory=self._factory, backend=self._backend_name, seed=self.seed
        )
        message = "\n".join(
            [
                f"graphmode check {violation.check!r} failed at step {step} (seed {self.seed})",
                violation.describe(),
                f"step {step}: {batch.num_reqs} requests, {batch.num_tokens} tokens, phase "
                f"{batch.phase}, query lengths {batch.query_lens}",
                "replay the minimal schedule with:",
                snippet,
            ]
        )
        failure = Failure(violation.check, step, message, self.seed, snippet)
        raise GraphmodeFailure(failure, self.stats)
