"""Hypothesis strategies for graph-mode fuzzing: the harness as scheduler.

- `plans`: `StepPlan`, `Arrival`, `Stress`: a schedule's steps in abstract form.
- `scheduler`: `BlockScheduler` and `compile_schedule`: block allocation and request lifecycles that
  turn plans into legal `Batch`es.
- `schedules`: `schedules(spec, max_steps)`, `step_plans(spec)`, `batch_lists(spec, max_steps)`
  and their parts, derived from a `TargetSpec`.
- `leading`: the fixed schedules a campaign runs before it draws any (`LEADING_EXAMPLES`,
  `first_pair` to `first_return_after_padded_steps`).
- `swarm`: `swarms(spec)`, the features and stressors one schedule leaves on (swarm testing).
- `stressors`: what happens to a target between steps (poison, churn, delays).
- `stream_delays`: `delayed_streams(cycles, hold_cycles=0, held_stream=None, met=None)` and
  `delayed_compute(...)`, the cuda delays on every stream a step uses or on one alone (`met`, a
  `StreamsMet` shared across a runner's steps, takes `held_stream` modulo the streams they met);
  `sleep_cycles_per_second(device)`.
"""
