"""Per-step oracles on what a step returns: pure functions over its batch, results and states.

They know nothing about a runner's internals, so they judge any `GraphTarget`. Each returns the
violations it found (empty when the step is fine); the first one fails the campaign. Check names
are public: reports, statistics and users' filters refer to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytest_graphmode.contract import Batch, StepResult, TargetSpec, slot_major
from pytest_graphmode.fuzz.kv_checks import State, row_mask, valid_slots
from pytest_graphmode.fuzz.tolerance import (
    argmax_decided,
    logit_distance,
    row_tolerance,
    same_bits,
    sample_decided,
)
from pytest_graphmode.fuzz.violation import Violation, differences
from pytest_graphmode.strategies.idle_blocks import marked_rows

REPLAY_MATCHES_EAGER = "replay_matches_eager"
PADDING_INERT = "padding_inert"
RESULTS_STAY_VALID = "results_stay_valid"


@dataclass(frozen=True)
class Outcome:
    """What one twin's step produced: a result, or the traceback of what it raised."""

    result: StepResult | None
    error: str | None = None


def _shape_problem(batch: Batch, result: StepResult, spec: TargetSpec) -> str | None:
    want = (batch.num_reqs, spec.vocab_size)
    if tuple(result.logits.shape) != want:
        return f"logits have shape {tuple(result.logits.shape)}, want {want}"
    if tuple(result.next_tokens.shape) != (batch.num_reqs,):
        return f"next_tokens have shape {tuple(result.next_tokens.shape)}, want {(batch.num_reqs,)}"
    return None


def both_raised(graph_error: str, eager_error: str, when: str = "on a legal batch") -> str:
    """Both tracebacks, unless the graph twin's ends as the eager twin's does (the same
    exception and message): then the eager twin's, said to be shared. `when`: where they raised."""
    if _last_line(graph_error) == _last_line(eager_error):
        return f"both twins raised the same error {when}; eager twin's:\n{eager_error}"
    return (
        f"both twins raised {when}; eager twin's error:\n{eager_error}\n"
        f"graph twin's error:\n{graph_error}"
    )


# The sim's refusals of a call it cannot run (`runtime.backends.sim.limits`): a limit of the sim,
# not a finding about the runner. Said first, so that the check's name does not read as one.
_SIM_REFUSALS = (
    "SimUnsupportedError:",
    "SimKernelMissing:",
    # A torch.cuda call the drop-in does not stand in for reaches the CPU build's own code, which
    # has no CUDA binding to call: the sim's gap, not the runner's.
    "has no attribute '_cuda",
)


def sim_refusal(*errors: str | None) -> str:
    """A lead naming the sim's refusal that ended one of `errors` (tracebacks), or ""."""
    for error in errors:
        if error and any(name in _last_line(error) for name in _SIM_REFUSALS):
            return (
                "sim_unsupported: the sim cannot run a call this runner makes (a limit of the sim, "
                "not a finding about the runner: fuzz this path with --graphmode-backend=cuda):\n"
                f"{_last_line(error)}\n"
            )
    return ""


def _last_line(error: str) -> str:
    lines = error.strip().splitlines()
    return lines[-1] if lines else ""


def replay_matches_eager(
    batch: Batch,
    graph: Outcome,
    eager: Outcome,
    spec: TargetSpec,
    precision: torch.dtype | None = None,
) -> list[Violation]:
    """Graph logits match eager within tolerance (-inf, a masked token, on both or neither; never
    NaN or +inf); tokens match where decidable; no twin raises on a legal batch, in its step or in
    a method the harness calls around it. `precision`: the twin's `state_precision`, the finest
    the logits can be (`tolerance.row_tolerance`). (What a method raised outside the step is
    judged where it escapes: `Lockstep._fail_escaped`.)"""
    name = REPLAY_MATCHES_EAGER
    if graph.error or eager.error:
        if graph.error and eager.error:
            detail = both_raised(graph.error, eager.error)
        elif graph.error:
            detail = f"graph_raised: the graph twin raised, the eager twin did not:\n{graph.error}"
        else:
            detail = f"eager_raised: the eager twin raised, the graph twin did not:\n{eager.error}"
        return [Violation(name, sim_refusal(graph.error, eager.error) + detail)]
    assert graph.result is not None and eager.result is not None
    for twin, result in (("graph", graph.result), ("eager", eager.result)):
        problem = _shape_problem(batch, result, spec)
        if problem:
            return [Violation(name, f"{twin} twin: {problem}")]
    g, e = graph.result.logits.detach().cpu(), eager.result.logits.detach().cpu()
    for twin, logits in (("graph", g), ("eager", e)):
        # -inf is a masked token (a grammar's bitmask, a top-k filter); it must then be masked
        # on both twins, which the distance below demands. NaN and +inf are no logit's values.
        sound = ~(logits.isnan() | logits.isposinf())
        if not bool(sound.all()):
            row = int((~sound.all(dim=-1)).nonzero()[0])
            return [
                _row_violation(
                    name,
                    f"{twin} twin's logits hold NaN or +inf",
                    batch,
                    row,
                    "logits that are finite, or -inf where a token is masked",
                    differences(logits[row], logits[row], sound[row])["actual"],
                )
            ]
    tol = row_tolerance(e, precision)
    far = logit_distance(g, e) > tol[:, None]
    if bool(far.any()):
        row, col = (int(i) for i in far.nonzero()[0])
        return [
            _row_violation(
                name,
                f"graph logit of token {col} differs from eager beyond tolerance {tol[row]:.3g}",
                batch,
                row,
                f"{float(e[row, col])!r}",
                f"{float(g[row, col])!r}",
            )
        ]
    return _token_violations(name, batch, graph.result, eager.result, e, g, tol)


def _token_violations(
    name: str,
    batch: Batch,
    graph: StepResult,
    eager: StepResult,
    e: torch.Tensor,
    g: torch.Tensor,
    tol: torch.Tensor,
) -> list[Violation]:
    gt, et = graph.next_tokens.cpu().tolist(), eager.next_tokens.cpu().tolist()
    decided = argmax_decided(e, tol)
    gap = logit_distance(g, e).amax(dim=-1)
    for row, request in enumerate(batch.requests):
        if not 0 <= gt[row] < e.shape[-1]:
            return [
                _row_violation(
                    name,
                    "graph twin's next token is outside the vocabulary",
                    batch,
                    row,
                    f"in [0, {e.shape[-1]})",
                    str(gt[row]),
                )
            ]
        if request.seed is None:
            decidable = bool(decided[row])
            why = "greedy token differs although eager's top-2 margin exceeds the tolerance"
        else:
            decidable = sample_decided(float(gap[row]), request.temperature)
            why = f"sampled token (seed {request.seed}) differs although the logits agree"
        if decidable and gt[row] != et[row]:
            return [_row_violation(name, why, batch, row, str(et[row]), str(gt[row]))]
    return []


def _row_violation(
    name: str, detail: str, batch: Batch, row: int, expected: str | None, actual: str | None
) -> Violation:
    req_id = batch.requests[row].req_id if row < batch.num_reqs else None
    return Violation(name, detail, req_id=req_id, row=row, expected=expected, actual=actual)


def padding_inert(
    batch: Batch,
    poisoned: Outcome,
    clean: Outcome,
    poisoned_after: State,
    clean_after: State,
    spec: TargetSpec,
    also: Sequence[Batch] = (),
    eager_after: State | None = None,
) -> list[Violation]:
    """Valid rows and valid KV slots are bit-identical whether or not padding rows, static
    buffers and the null block were poisoned before the step. The blocks no request of the step
    lists hold the harness's mark on the poisoned twin during the step and their contents on the
    clean one, so a valid row that reads one of them fails here too. `also`: steps that also ran before
    the states were taken (the other step of a pipelined pair); their slots count too.

    The harness marks the slots a step must write on the poisoned and eager twins, not on the
    clean one (`idle_blocks.py`). A slot that still holds the mark on both afterwards is state
    the runner writes less often than once a token (docs/contract.md), left unwritten alike by
    both: it is not compared with the clean twin's, which holds whatever it held before."""
    name = PADDING_INERT
    if poisoned.result is None or clean.result is None:
        if poisoned.error and not clean.error:
            return [
                Violation(
                    name,
                    f"the poisoned graph twin raised, the clean one did not:\n{poisoned.error}",
                )
            ]
        return []
    p, c = poisoned.result, clean.result
    if p.path != c.path or p.graph_key != c.graph_key:
        return [
            Violation(
                name,
                "poisoning changed the dispatch",
                expected=f"{c.path} {c.graph_key}",
                actual=f"{p.path} {p.graph_key}",
            )
        ]
    equal = same_bits(p.logits.detach().cpu(), c.logits.detach().cpu()).all(dim=-1)
    equal &= p.next_tokens.cpu() == c.next_tokens.cpu()
    if not bool(equal.all()):
        row = int((~equal).nonzero()[0])
        return [
            _row_violation(
                name,
                "a valid row changed when padding and static buffers were poisoned (or it "
                "read a block no request of the step lists, which holds the harness's mark "
                "on the poisoned twin and its old contents on the clean one)",
                batch,
                row,
                *_token_and_logits(c, p, row),
            )
        ]
    owners = {
        slot: req for written in (batch, *also) for slot, req in valid_slots(written, spec).items()
    }
    slots = list(owners)
    for key, expected in clean_after.items():
        actual = poisoned_after.get(key)
        if actual is None or not slot_major(expected, spec) or actual.shape != expected.shape:
            continue
        rows = row_mask(same_bits(actual[slots], expected[slots]))
        if not bool(rows.all()) and eager_after is not None and key in eager_after:
            index = torch.tensor(slots)
            rows |= marked_rows(actual, index) & marked_rows(eager_after[key], index)
        if not bool(rows.all()):
            slot = slots[int((~rows).nonzero()[0])]
            return [
                Violation(
                    name,
                    f"valid KV slot {slot} of {key!r} holds other bits when the "
                    f"graph twin was poisoned (or when a block no request of the step lists "
                    f"held the harness's mark)",
                    slot=slot,
                    req_id=owners[slot],
                    **differences(expected[slot], actual[slot]),
                )
            ]
    return []


def _token_and_logits(expected: StepResult, actual: StepResult, row: int) -> tuple[str, str]:
    texts = differences(expected.logits[row], actual.logits[row])
    return (
        f"token {int(expected.next_tokens[row])}, logit {texts['expected']}",
        f"token {int(actual.next_tokens[row])}, logit {texts['actual']}",
    )


def results_stay_valid(
    kept: StepResult, snapshot: tuple[torch.Tensor, torch.Tensor], kept_step: int
) -> list[Violation]:
    """A result returned at `kept_step` is unchanged after the next step (no aliasing of graph
    outputs); `snapshot` holds clones of its logits and next_tokens taken when it was returned."""
    for field, now, then in (
        ("logits", kept.logits, snapshot[0]),
        ("next_tokens", kept.next_tokens, snapshot[1]),
    ):
        equal = same_bits(now.detach().cpu(), then)
        if not bool(equal.all()):
            row = int((~equal).reshape(equal.shape[0], -1).any(dim=1).nonzero()[0])
            return [
                Violation(
                    RESULTS_STAY_VALID,
                    f"the {field} returned at step {kept_step} changed during the next step: the "
                    f"result aliases a buffer the runner reuses; return a copy",
                    row=row,
                    **differences(then[row], now[row]),
                )
            ]
    return []


def results_disjoint(
    result: StepResult, step: int, other: StepResult, other_step: int
) -> list[Violation]:
    """Results of two steps the caller held at once share no memory: the later step would have
    written into a result the caller still owned. Judged on addresses, not values, so that a
    pipelined pair needs no read of the first step's result before the second is submitted."""
    for field, mine in (("logits", result.logits), ("next_tokens", result.next_tokens)):
        for theirs in (other.logits, other.next_tokens):
            if _overlap(mine, theirs):
                first, second = sorted((step, other_step))
                return [
                    Violation(
                        RESULTS_STAY_VALID,
                        f"the {field} returned at step {step} share memory with a result of step "
                        f"{other_step}: step {second} wrote into the result of step {first}, "
                        f"which the caller still held; return a copy",
                    )
                ]
    return []


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    return _span(a)[0] < _span(b)[1] and _span(b)[0] < _span(a)[1]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes between a tensor's first and last element (whatever its strides)."""
    low = high = t.data_ptr()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        reach = (size - 1) * stride * t.element_size()
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + t.element_size()
