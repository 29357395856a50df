"""The fuzz engine: drive a graph twin and an eager twin of any runner in lockstep and prove, on
every step, that replay matches eager, padding rows have no side effects and address views never
collide.

Public API (stable; the pytest plugin is built on it):

- `run_campaign(factory, *, backend="sim", max_examples=50, max_steps=12, seed=None,
  features=None, progress=None, settings=None, stats=None, shrink_seconds=None,
  on_example=None, pipelined=True, seconds=None, cpu_threads=1, stop=None, leading=True)
  -> CampaignStats`:
  Hypothesis draws schedules of legal batches and stressors (with pipelined pairs unless
  `pipelined=False`, the first twelve examples then being fixed: the simplest pipelined pairs
  (`first_pair`), `first_phase_change`, `first_partial_bucket`, `first_front_departure`,
  `first_stale_tail`, `first_handover`, `first_stream_sweep`,
  `first_tokens_past_the_largest_graph`, `first_capture_on_long_contexts`,
  `first_graph_stream_sweep`, `first_return_after_preemption` and
  `first_return_after_padded_steps`, which `leading=False` leaves out; each schedule
  switches a random part of the features and stressors off, `strategies/swarm.py`), run on twins
  kept across examples (`kept_twins.py`, docs/contract.md "Kept twins");
  the first failure is shrunk to its smallest schedule (within `shrink_seconds`, when given) and
  raised as `GraphmodeFailure` (its `.stats` holds the statistics so far). `stats` is counted
  into as the campaign runs, so its caller keeps the counts of an interrupted campaign.
  `seconds` is a time budget: no example starts once it is spent, and the campaign then passes
  (a failure found before is still shrunk and raised). `cpu_threads` sets torch's intra-op CPU
  threads while it runs (None: as they are; `campaign_process.py` says why 1). `stop()`, asked
  before each example while nothing has failed, ends the campaign as passed when true. The
  device running out of memory outside a step ends it with torch's `OutOfMemoryError`, unshrunk.
- `isolation.run_isolated(..., check_twins_first=False)`: the same campaign in a child process; a
  device fault or a dead child is a failure of `no_device_fault` (docs/ci.md, "Device faults");
  with `check_twins_first`, the child checks the twins against the contract first (the check the
  plugin makes before its first campaign) and its `TargetError` is raised here; the child out of
  device memory outside a step raises `CampaignOutOfMemory` (an `IsolatedCampaignError`); `stop`
  as in `run_campaign`.
- `helpers.run_with_helpers(campaign, factory, *, helpers, seconds, seed, stats=None,
  progress=None, **arguments)`: `campaign` (either of the above) under the time budget `seconds`
  with `helpers` helper campaigns in child processes beside it, each with its own seed; the first
  failure of any process is raised, with every process's statistics (docs/ci.md, "Workers"); a
  helper out of device memory outside a step stops with a `RuntimeWarning`, the others go on.
- `replay(batches, *, factory, backend="sim", seed=0) -> CampaignStats`: re-run a concrete
  schedule (a list of `Batch`, optionally with `Stress` events, and `Reset` events that start the
  next example on the same twins) with every check; a failure's `replay_snippet` is such a call.
- `CampaignStats`: examples, steps, pipelined_steps, buckets_hit, paths, fallback_reasons, checks_run, failures,
  seconds, the first failure as found (`first_failure_seconds`, `_example`, `_check`) and its
  shrinking (`shrinking`, `shrink_seconds`, `shrink_budget_seconds`, `shrink_stopped_by_budget`),
  `planned_examples`, `time_budget_seconds`, `stopped_by_time_budget`; `merge(other)` (xdist aggregation), `to_json()` and `from_json()`.
- `Failure(check, step, message, seed, replay_snippet)`, and `GraphmodeFailure(AssertionError)`
  with `.failure` and `.stats`.
- `CHECKS`: the name of every check a campaign can fail with, in the order they run within a
  step: those of `registry.REGISTRY`, run by every campaign, then `registry.RANK_CHECKS`, run only
  by data-parallel campaigns.

`CampaignStats`, `Failure` and `GraphmodeFailure` live in torch-free modules and are exported from
`pytest_graphmode` too.

`factory` is a `TargetFactory`: `factory(mode, *, seed, backend) -> GraphTarget`. Every target
made is closed, also when a check fails.

How each bug class of docs/bug-classes.md is provoked (before the arrow) and seen (after it):

1. padding rows: poisoned static buffers holding live block/slot ids, a NaN null block, the
   blocks no request of the step lists marked during the step -> kv_writes_confined,
   padding_inert
2. randomness: sampled requests in other buckets, padding and company (and, on a twin of their
   own, about half of the greedy requests, whose per-row state must follow them too)
   -> replay_matches_eager, sampling_independent, company_independent
3. stale buffers: every static buffer poisoned before every step, the slots each step must write
   marked before it -> padding_inert, kv_writes_land
4. host values: replays of other contents and lengths than the capture batch
   -> replay_matches_eager, states_match
5. graph key: same-size steps of another kind, query length or adapter mix
   -> replay_matches_eager
6. addresses: allocator churn, eager steps above the largest capture size
   -> replay_matches_eager, padding_inert
7. aliasing: results kept across the next step, and in pipelined pairs held unread while it
   runs -> results_stay_valid
8. async staging: cuda: a sleep kernel before the step and, in the graph twin's step, ahead of
   every asynchronous host copy and event record on its own stream; sim: a reseeded stream order,
   and the happens-before race checker, which needs no lucky order; both: pipelined pairs, the
   next step sent before the last one is read
   -> no_stream_races (sim), replay_matches_eager (no_device_fault where the stale values are
   used as indices)
9. pool accounting: several buckets captured per example
   -> pool_within_bound, address_views_disjoint
10. capture coverage: fresh inputs on every replay after capture
   -> replay_matches_eager, states_match
11. cross-rank consistency: with `ranks` > 1 (`fuzz.ranks.run_rank_campaign`), a batch per rank,
   idle ranks, a prefill or adapter on one rank, a rank forced eager or failing its captures
   -> ranks_agree, ranks_arrive (plus every check above on every rank)
12. piecewise: prefill, mixed and oversized steps on a piecewise runner
   -> replay_matches_eager, kv_writes_confined
"""

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.failure import Failure, GraphmodeFailure
from pytest_graphmode.fuzz.campaign import run_campaign
from pytest_graphmode.fuzz.registry import CHECKS
from pytest_graphmode.fuzz.replay import replay

__all__ = ["CHECKS", "CampaignStats", "Failure", "GraphmodeFailure", "replay", "run_campaign"]
