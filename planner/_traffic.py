"""Decode batch sizes from request traffic: a continuous-batching simulation.

The model, stated so its numbers can be reproduced:
- time advances in fixed steps of `step_s` seconds (one engine iteration each);
- a request is admitted at the first step that starts at or after its arrival, first come
  first served, while fewer than `max_running` requests hold a slot;
- its prefill takes ceil(prompt_tokens / prefill_chunk) steps and yields the first output token;
- it then joins the decode batch and decodes one token per step until it has all its output
  tokens, and frees its slot after its last decode step;
- a step's decode batch size is the number of admitted requests past their prefill; steps with
  no decoding request are idle and not counted.

Input: the Azure LLM inference trace 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
"""

from __future__ import annotations

import csv
import heapq
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds since the first request of the trace
    prompt_tokens: int
    output_tokens: int


def _seconds(stamp: str) -> float:
    # The trace writes 7 fractional digits, more than datetime parses: split them off.
    whole, _, fraction = stamp.partition(".")
    moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def read_azure_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = tuple(next(reader, ()))
        if header != AZURE_HEADER:
            raise ValueError(f"{path}: expected the header {','.join(AZURE_HEADER)}, got {header}")
        raw = []
        for line, row in enumerate(reader, start=2):
            try:
                raw.append((_seconds(row[0]), int(row[1]), int(row[2])))
            except (ValueError, IndexError):
                raise ValueError(f"{path}:{line}: cannot read the request {row}") from None
    if not raw:
        raise ValueError(f"{path}: the trace has no requests")
    raw.sort()
    start = raw[0][0]
    return [TraceRequest(at - start, prompt, output) for at, prompt, output in raw]


def halves(requests: Sequence[TraceRequest]) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Split requests in arrival order (as read) at the middle one; each half's clock restarts
    at zero."""
    middle = len(requests) // 2
    first = list(requests[:middle])
    second = [
        TraceRequest(r.arrival_s - requests[middle].arrival_s, r.prompt_tokens, r.output_tokens)
        for r in requests[middle:]
    ]
    return first, second


def decode_runs(
    requests: Sequence[TraceRequest],
    *,
    step_s: float = 0.030,
    max_running: int = 256,
    prefill_chunk: int = 2048,
    rate_scale: float = 1.0,
) -> Iterator[tuple[int, int]]:
    """(decode batch size, consecutive steps) in step order; `rate_scale=2` halves arrival times.

    Arguments are validated before the first run is produced.
    """
    if not step_s > 0 or not rate_scale > 0:
        raise ValueError(f"step_s and rate_scale must be > 0, got {step_s} and {rate_scale}")
    if max_running < 1 or prefill_chunk < 1:
        raise ValueError(
            f"max_running and prefill_chunk must be >= 1, got {max_running} and {prefill_chunk}"
        )
    if not requests:
        raise ValueError("no requests to simulate")
    order = sorted(requests, key=lambda r: r.arrival_s)
    arrival_steps = [math.ceil(r.arrival_s / rate_scale / step_s - 1e-9) for r in order]
    return _runs(order, arrival_steps, max_running, prefill_chunk)


def _runs(
    order: list[TraceRequest], arrival_steps: list[int], max_running: int, prefill_chunk: int
) -> Iterator[tuple[int, int]]:
    slot_ends: list[int] = []  # last step each admitted request holds its slot
    prefill_ends: list[int] = []  # last prefill step of requests still prefilling
    waiting_from = arrived = 0  # order[waiting_from:arrived] have arrived and wait for a slot
    step = arrival_steps[0]
    while True:
        while slot_ends and slot_ends[0] < step:
            heapq.heappop(slot_ends)
        while prefill_ends and prefill_ends[0] < step:
            heapq.heappop(prefill_ends)
        while arrived < len(order) and arrival_steps[arrived] <= step:
            arrived += 1
        while waiting_from < arrived and len(slot_ends) < max_running:
            request = order[waiting_from]
            prefill_steps = max(1, math.ceil(request.prompt_tokens / prefill_chunk))
            last_prefill = step + prefill_steps - 1
            heapq.heappush(prefill_ends, last_prefill)
            heapq.heappush(slot_ends, last_prefill + max(request.output_tokens - 1, 0))
            waiting_from += 1
        # The state holds until the next prefill finishes, a slot frees or a request arrives.
        events: list[float] = [math.inf]
        events += [slot_ends[0] + 1] if slot_ends else []
        events += [prefill_ends[0] + 1] if prefill_ends else []
        events += [arrival_steps[arrived]] if arrived < len(order) else []
        following = min(events)
        if following == math.inf:
            return
        batch = len(slot_ends) - len(prefill_ends)
        if batch > 0:
            yield batch, int(following) - step
        step = int(following)


def simulate(
    requests: Sequence[TraceRequest],
    *,
    step_s: float = 0.030,
    max_running: int = 256,
    prefill_chunk: int = 2048,
    rate_scale: float = 1.0,
) -> dict[int, int]:
    """Histogram {decode batch size: steps} of `decode_runs` with the same arguments."""
    histogram: Counter[int] = Counter()
    runs = decode_runs(
        requests,
        step_s=step_s,
        max_running=max_running,
        prefill_chunk=prefill_chunk,
        rate_scale=rate_scale,
    )
    for batch, steps in runs:
        histogram[batch] += steps
    return dict(sorted(histogram.items()))
