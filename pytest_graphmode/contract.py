"""The target contract: what any graph runner implements so the harness can drive it.

Version 1. The harness drives a graph twin and an eager twin made with the same seed through the
same batches and compares them; everything here is what it needs to see. Keep it stable: runners
written by others depend on these names and semantics (see docs/contract.md).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor

CONTRACT_VERSION = 1

Phase = Literal["decode", "prefill", "mixed"]
Path = Literal["full", "piecewise", "eager"]
FEATURES = frozenset({"decode", "prefill", "spec_decode", "sampling", "adapters", "weight_update"})


@dataclass(frozen=True)
class Request:
    """One request's share of a step.

    `tokens` are this step's query tokens (decode: 1, speculative decode: 1 + k, prefill chunk: n).
    `block_ids` are the physical KV blocks covering `context_len + len(tokens)` positions, in order.
    """

    req_id: int
    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    seed: int | None = None
    temperature: float = 1.0
    adapter: int = 0

    @property
    def query_len(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after this step."""
        return self.context_len + len(self.tokens)


@dataclass(frozen=True)
class Batch:
    requests: tuple[Request, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(len(r.tokens) for r in self.requests)

    @property
    def uniform(self) -> bool:
        """Every request has the same query length (decode or speculative decode shape)."""
        return len(set(self.query_lens)) <= 1

    @property
    def phase(self) -> Phase:
        """prefill: every request starts from an empty cache; decode: every request continues a
        cached sequence with the same query length; mixed: anything else."""
        if self.requests and all(r.context_len == 0 for r in self.requests):
            return "prefill"
        if all(r.context_len > 0 for r in self.requests) and self.uniform:
            return "decode"
        return "mixed"

    @property
    def adapters(self) -> frozenset[int]:
        return frozenset(r.adapter for r in self.requests)


@dataclass(frozen=True)
class TargetSpec:
    num_blocks: int
    block_size: int
    max_blocks_per_req: int
    vocab_size: int
    max_num_reqs: int
    max_num_tokens: int
    capture_sizes: tuple[int, ...]
    features: frozenset[str] = field(default_factory=lambda: frozenset({"decode"}))
    null_block: int = 0
    # With the "adapters" feature, requests name adapters 0 (the base) to num_adapters.
    num_adapters: int = 1
    # False: a request's logits may depend on the other requests of its batch and their order
    # (capacity-limited expert routing, a norm over the batch), so the company twin runs the
    # whole batch in its order, from other KV blocks, instead of the sampled requests alone, and
    # no greedy company twin runs some greedy requests apart.
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        problems = spec_problems(self)
        if problems:
            raise ValueError("inconsistent TargetSpec: " + "; ".join(problems))

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def spec_problems(spec: TargetSpec) -> list[str]:
    """Every reason `spec` cannot describe a real runner; empty when it is consistent."""
    problems = []
    for name in ("num_blocks", "block_size", "max_blocks_per_req", "vocab_size"):
        if getattr(spec, name) < 1:
            problems.append(f"{name}={getattr(spec, name)} must be >= 1")
    if spec.max_num_reqs < 1 or spec.max_num_tokens < spec.max_num_reqs:
        problems.append(
            f"need 1 <= max_num_reqs ({spec.max_num_reqs}) <= max_num_tokens ({spec.max_num_tokens})"
        )
    if not 0 <= spec.null_block < spec.num_blocks:
        problems.append(f"null_block={spec.null_block} outside [0, {spec.num_blocks})")
    if spec.num_blocks < 2:
        problems.append("need at least one block besides the null block")
    sizes = spec.capture_sizes
    if list(sizes) != sorted(set(sizes)) or any(s < 1 for s in sizes):
        problems.append(f"capture_sizes {sizes} must be positive, strictly increasing")
    elif sizes and sizes[-1] > spec.max_num_tokens:
        problems.append(f"largest capture size {sizes[-1]} > max_num_tokens {spec.max_num_tokens}")
    unknown = set(spec.features) - FEATURES
    if unknown:
        problems.append(f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
    least = 1 if "adapters" in spec.features else 0
    if not _is_int(spec.num_adapters) or spec.num_adapters < least:
        needs = "with the 'adapters' feature" if least else "as a count"
        problems.append(f"num_adapters={spec.num_adapters!r} must be an integer >= {least} {needs}")
    if not isinstance(spec.batch_invariant, bool):
        problems.append(f"batch_invariant={spec.batch_invariant!r} must be True or False")
    return problems


def kv_slot(block_ids: Sequence[int], position: int, block_size: int) -> int:
    """The slot-major KV row of token `position` of a sequence stored in `block_ids`."""
    return block_ids[position // block_size] * block_size + position % block_size


def request_slots(request: Request, block_size: int) -> list[int]:
    """The KV slots a step writes for `request`: its positions `context_len .. seq_len - 1`."""
    return [
        kv_slot(request.block_ids, position, block_size)
        for position in range(request.context_len, request.seq_len)
    ]


def slot_major(tensor: Tensor, spec: TargetSpec) -> bool:
    """Whether a `state()` tensor is laid out one row per KV slot of `spec`: the tensors the
    harness compares, poisons and marks slot by slot."""
    return tensor.dim() > 0 and tensor.shape[0] == spec.num_slots


_INT64_MAX = 2**63 - 1


def batch_problems(batch: Batch, spec: TargetSpec) -> list[str]:
    """Every reason `batch` is not a legal step for `spec`; empty when it is legal.

    The harness sends only legal batches; a runner may refuse any other. Ids may be any integer
    type (numpy's included), temperatures any real type. Each request lists the blocks covering
    its `seq_len` positions, in order (more, up to `max_blocks_per_req`, is allowed: a block
    manager may allocate ahead). A block belongs to ONE request: two requests of a batch never
    list the same block, even at different slots, as in a paged KV cache whose block manager
    hands each block to one sequence. The null block belongs to padding only.
    """
    if not isinstance(batch, Batch):
        return [f"expected a Batch, got {type(batch).__name__}"]
    strangers = [
        f"row {row} is a {type(r).__name__}, not a Request"
        for row, r in enumerate(batch.requests)
        if not isinstance(r, Request)
    ]
    if strangers:
        return strangers
    problems: list[str] = []
    if batch.num_reqs == 0:
        problems.append("no requests: a step needs at least one request")
    if batch.num_reqs > spec.max_num_reqs:
        problems.append(f"{batch.num_reqs} requests exceed max_num_reqs={spec.max_num_reqs}")
    if batch.num_tokens > spec.max_num_tokens:
        problems.append(f"{batch.num_tokens} tokens exceed max_num_tokens={spec.max_num_tokens}")
    rows: dict[object, int] = {}
    owners: dict[object, str] = {}
    for row, request in enumerate(batch.requests):
        where = f"request {request.req_id} (row {row})"
        if request.req_id in rows:
            problems.append(f"{where}: req_id also used by row {rows[request.req_id]}")
        rows[request.req_id] = row
        own = _request_problems(request, spec)
        problems.extend(f"{where}: {p}" for p in own)
        if own:
            continue  # ownership of a malformed request's blocks means nothing
        for block in request.block_ids:
            if block in owners:
                problems.append(
                    f"{where}: block {block} also belongs to {owners[block]}; a block belongs "
                    "to one request"
                )
            owners[block] = where
    return problems


def _request_problems(request: Request, spec: TargetSpec) -> list[str]:
    problems: list[str] = []
    if not _is_int(request.req_id):
        problems.append(f"req_id={request.req_id!r} must be an integer")
    tokens = request.tokens
    if len(tokens) == 0:
        problems.append("has no query tokens")
    not_ints = [t for t in tokens if not _is_int(t)]
    if not_ints:
        problems.append(f"token ids {not_ints[:4]} are not integers")
    outside = [t for t in tokens if _is_int(t) and not 0 <= t < spec.vocab_size]
    if outside:
        problems.append(f"token ids {outside[:4]} outside the vocabulary [0, {spec.vocab_size})")
    if not _is_int(request.context_len) or request.context_len < 0:
        problems.append(f"context_len={request.context_len!r} must be an integer >= 0")
        return problems
    blocks = request.block_ids
    needed = -(-request.seq_len // spec.block_size)
    if len(blocks) < needed:
        problems.append(
            f"block table too short: {len(blocks)} blocks of {spec.block_size} slots cannot "
            f"hold context {request.context_len} + query {request.query_len}; needs {needed}"
        )
    if len(blocks) > spec.max_blocks_per_req:
        problems.append(f"{len(blocks)} blocks exceed max_blocks_per_req={spec.max_blocks_per_req}")
    bad_blocks = [b for b in blocks if not _is_int(b) or not 0 <= b < spec.num_blocks]
    if bad_blocks:
        problems.append(f"block ids {bad_blocks[:4]} outside [0, {spec.num_blocks})")
    if spec.null_block in blocks:
        problems.append(f"uses the null block {spec.null_block}, which belongs to padding only")
    if len(set(blocks)) != len(blocks):
        problems.append(f"lists a block twice in {list(blocks)}")
    if request.seed is not None:
        if not _is_int(request.seed) or not 0 <= request.seed <= _INT64_MAX:
            problems.append(f"seed={request.seed!r} must be None (greedy) or an int in [0, 2**63)")
        elif "sampling" not in spec.features:
            problems.append("is sampled (seed set) but the target lacks the 'sampling' feature")
    temperature = request.temperature
    if (
        not isinstance(temperature, numbers.Real)
        or isinstance(temperature, bool)
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        problems.append(f"temperature={temperature!r} must be a finite real number > 0")
    if not _is_int(request.adapter) or request.adapter < 0:
        problems.append(f"adapter={request.adapter!r} must be an integer >= 0 (0 = base)")
    elif request.adapter and "adapters" not in spec.features:
        problems.append(
            f"uses adapter {request.adapter} but the target lacks the 'adapters' feature"
        )
    elif request.adapter > spec.num_adapters:
        problems.append(f"adapter={request.adapter} outside [0, num_adapters={spec.num_adapters}]")
    return problems


def _is_int(value: object) -> bool:
    """Python and numpy integers alike; bools are flags, not ids."""
    # A plain int first: the ABC check costs a few microseconds, and every step checks every
    # token, block and id of its batch on each twin.
    return type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
    )


@dataclass
class StepResult:
    """What one step returns. `logits` is `[num_reqs, vocab]` at each request's last query token
    and belongs to the caller: the next step must not change it."""

    logits: Tensor
    next_tokens: Tensor
    path: Path
    graph_key: Hashable | None
    reason: str | None = None  # why this path was taken (e.g. the eager fallback's cause); optional


@dataclass(frozen=True)
class AddressView:
    """One captured graph's virtual address range `[base, base + size)` and what it maps."""

    graph_key: Hashable
    base: int
    size: int
    physical: str | None = None
    offset: int = 0

    @property
    def end(self) -> int:
        return self.base + self.size


@runtime_checkable
class GraphTarget(Protocol):
    """A runner under test. KV tensors in `state()` are slot-major: `[num_blocks * block_size, ...]`."""

    spec: TargetSpec

    def step(self, batch: Batch) -> StepResult: ...

    def state(self) -> Mapping[str, Tensor]: ...

    def static_buffers(self) -> Mapping[str, Tensor]: ...

    def address_views(self) -> Sequence[AddressView]: ...

    def update_weights(self, seed: int) -> None: ...

    def close(self) -> None: ...


class TargetFactory(Protocol):
    def __call__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str
    ) -> GraphTarget: ...


TARGET_METHODS = ("step", "state", "static_buffers", "address_views", "update_weights", "close")
