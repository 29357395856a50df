"""The target contract: what any graph runner implements so the harness can drive it.

Version 1. The harness drives a graph twin and an eager twin made with the same seed through the
same batches and compares them; everything here is what it needs to see. Keep it stable: runners
written by others depend on these names and semantics (see docs/contract.md).
"""

from __future__ import annotations

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
    return problems


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
