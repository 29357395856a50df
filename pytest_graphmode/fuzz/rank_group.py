"""A rank process's membership: the torch.distributed groups and the progress it shows the parent.

Three groups over every rank: one for the graph twins' coordination, one for the clean twins', and
a gloo group for the harness's own exchange of reports (plain Python objects, whatever backend the
targets use). The default group is gloo with CPU tensors on sim and NCCL with this rank's GPU on
cuda. Before and after every collective the rank writes its progress into memory the parent
shares (step reached, collectives entered, waiting in one), which is what the parent's watchdog
reads when it reports a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.fuzz.rank_checks import RankReport
from pytest_graphmode.fuzz.rank_lockstep import Finding, RankLockstep
from pytest_graphmode.runtime.data_parallel import DataParallel
from pytest_graphmode.strategies.rank_schedules import RankEvent, RankFault

# per rank: step reached, collectives entered, the one it waits in (0: none), the last one entered
STATUS_FIELDS = 4
COLLECTIVES = (
    "",
    "the graph twins' coordination",
    "the clean twins' coordination",
    "the report exchange",
)


@dataclass
class RankGroup:
    rank: int
    world: int
    backend: str
    device: torch.device
    groups: tuple[Any, Any]
    reports: Any
    status: Any

    @classmethod
    def join(
        cls,
        rank: int,
        world: int,
        backend: str,
        rendezvous: str,
        status: Any,
        timeout: timedelta,
    ) -> RankGroup:
        device = torch.device("cpu")
        if backend == "cuda":
            count = torch.cuda.device_count()
            if count < world:
                raise RuntimeError(
                    f"{world} ranks need {world} visible GPUs, this process sees {count}: "
                    "widen CUDA_VISIBLE_DEVICES (and do not combine -n with --graphmode-ranks)"
                )
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl" if backend == "cuda" else "gloo",
            init_method=rendezvous,
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        ranks = list(range(world))
        graph, clean = dist.new_group(ranks), dist.new_group(ranks)
        reports = dist.new_group(ranks, backend="gloo", timeout=timeout)
        return cls(rank, world, backend, device, (graph, clean), reports, status)

    def run_example(
        self, factory: TargetFactory, seed: int, events: list[RankEvent | RankFault]
    ) -> tuple[CampaignStats, Finding | None]:
        base = self.rank * STATUS_FIELDS
        self.status[base : base + STATUS_FIELDS] = [-1, 0, 0, 0]
        stats = CampaignStats()
        members = tuple(
            DataParallel(self.rank, self.world, group, self.device, watch=self._watcher(which))
            for which, group in enumerate(self.groups, start=1)
        )
        lockstep = RankLockstep(
            factory,
            backend=self.backend,
            seed=seed,
            stats=stats,
            members=(members[0], members[1]),
            exchange=self._exchange,
            arrive=self._arrive,
        )
        try:
            finding = lockstep.run_rank(events)
        finally:
            lockstep.close()
        return stats, finding

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _arrive(self, step: int) -> None:
        self.status[self.rank * STATUS_FIELDS] = step

    def _watcher(self, which: int) -> Callable[[str], None]:
        """Records entering and leaving collectives of kind `which` (an index of COLLECTIVES)."""
        base = self.rank * STATUS_FIELDS

        def watch(moment: str) -> None:
            if moment == "enter":
                self.status[base + 1] += 1
                self.status[base + 3] = which
            self.status[base + 2] = which if moment == "enter" else 0

        return watch

    def _exchange(self, report: RankReport) -> list[RankReport]:
        gathered: list[Any] = [None] * self.world
        watch = self._watcher(len(COLLECTIVES) - 1)
        watch("enter")
        dist.all_gather_object(gathered, report, group=self.reports)
        watch("leave")
        return gathered
