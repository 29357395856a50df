"""Piecewise graphs: graph pieces for the work between attention calls, eager attention between them.

Attention in prefill, chunked-prefill and mixed batches depends on the batch composition (how the
tokens split into requests), not only on the token count, so it cannot be replayed from a graph
captured for another composition. Everything between attention calls is token-wise and can. A
piecewise capture therefore ends the current graph at each attention call (a graph break), records an
attention runner holding the persistent q/k/v buffers the piece produced and an output buffer the
next piece reads, and begins the next graph. Attention is not executed during the capture.

Replay walks the recorded order: piece, runner, piece, ... Each runner runs attention eagerly with
this step's metadata (query offsets, sequence lengths, block tables) and must leave its result in the
captured output buffer: the next piece reads that address and no other. This address contract is
checked on every replay, not only in debug builds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.backends.errors import capture_error_of
from pytest_graphmode.runtime.model import DecoderInputs
from pytest_graphmode.runtime.model.attention import AttentionFn


class AddressContractError(RuntimeError):
    """A graph piece would read a tensor that is no longer at its captured address."""


class Runner(Protocol):
    """Eager work between two graph pieces; `run` returns the tensor the next piece reads."""

    layer: int
    out: Tensor

    def run(self, inputs: DecoderInputs, kv_cache: Tensor) -> Tensor: ...


@dataclass(eq=False)
class AttentionRunner:
    """Runs one layer's attention eagerly on the q/k/v a piece left in its persistent outputs."""

    layer: int
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    attention: AttentionFn

    def run(self, inputs: DecoderInputs, kv_cache: Tensor) -> Tensor:
        self.out.copy_(self.attention(self.layer, self.q, self.k, self.v, inputs, kv_cache))
        return self.out


RunnerFactory = Callable[[int, Tensor, Tensor, Tensor, Tensor, AttentionFn], Runner]
Body = Callable[[AttentionFn], Tensor]
"""Runs the model body on the static inputs with the given attention; returns hidden [T, H]."""

_TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping")


@dataclass(eq=False)
class PiecewiseGraph:
    num_tokens: int
    pieces: list[Any]  # backend Graphs, one more than runners
    runners: list[Runner]
    hidden: Tensor  # [T, H]: written by the last piece
    captured_outputs: list[int]  # data_ptr of each runner's output buffer at capture
    captured_inputs: dict[str, int]  # data_ptr of the token-wise static inputs at capture
    seconds: float

    def replay(self, inputs: DecoderInputs, kv_cache: Tensor) -> Tensor:
        """Replay every piece and runner in recorded order; returns the hidden states [T, H]."""
        self._check_inputs(inputs)
        self.pieces[0].replay()
        for index, runner in enumerate(self.runners):
            out = runner.run(inputs, kv_cache)
            self._check_output(index, out)
            self.pieces[index + 1].replay()
        return self.hidden

    def reset(self) -> None:
        for piece in self.pieces:
            piece.reset()

    def _check_inputs(self, inputs: DecoderInputs) -> None:
        for name, address in self.captured_inputs.items():
            tensor = getattr(inputs, name)
            if tensor.data_ptr() != address or tensor.shape[0] != self.num_tokens:
                raise AddressContractError(
                    f"piece 0 of the piecewise graph for {self.num_tokens} tokens reads static "
                    f"input {name!r} at 0x{address:x} [{self.num_tokens}], but this step passes "
                    f"0x{tensor.data_ptr():x} {list(tensor.shape)}: stage every step into the "
                    "same persistent buffers"
                )

    def _check_output(self, index: int, out: Tensor) -> None:
        expected = self.captured_outputs[index]
        if out.data_ptr() != expected:
            layer = self.runners[index].layer
            raise AddressContractError(
                f"piece {index + 1} reads the attention output of layer {layer} at "
                f"0x{expected:x}, but runner {index} left it at 0x{out.data_ptr():x}: an eager "
                "runner between pieces must write into the captured buffer (copy_), not allocate "
                "a new one"
            )


def capture_piecewise(
    backend: Backend,
    inputs: DecoderInputs,
    body: Body,
    attention: AttentionFn,
    *,
    pool: Any,
    runner_factory: RunnerFactory = AttentionRunner,
) -> PiecewiseGraph:
    """Capture `body` as graph pieces split at every attention call.

    `inputs` are the static inputs at the padded token count; all pieces allocate from `pool`
    (one pool for the whole piecewise graph, so a piece never reuses memory a later piece still
    reads). On failure nothing survives: every piece captured so far is reset and the exception
    propagates.
    """
    started = time.perf_counter()
    pieces: list[Any] = []
    runners: list[Runner] = []
    current: list[tuple[Any, Any]] = []  # the piece being captured and its capture context
    stream = backend.Stream()

    def begin() -> None:
        graph = backend.Graph()
        capture = backend.graph(graph, pool=pool, stream=stream)
        capture.__enter__()
        current.append((graph, capture))

    def end() -> None:
        graph, capture = current.pop()
        capture.__exit__(None, None, None)
        pieces.append(graph)

    def graph_break(layer: int, q: Tensor, k: Tensor, v: Tensor, *_: Any) -> Tensor:
        end()
        # Allocated between captures: the buffer belongs to the runner, not to any piece's pool.
        out = torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        runners.append(runner_factory(layer, q, k, v, out, attention))
        begin()
        return out

    try:
        begin()
        hidden = body(graph_break)
        end()
    except BaseException as exc:
        error = _abandon(current, pieces, exc)
        if error is not exc:
            raise error from exc
        raise
    return PiecewiseGraph(
        num_tokens=inputs.num_tokens,
        pieces=pieces,
        runners=runners,
        hidden=hidden,
        captured_outputs=[r.out.data_ptr() for r in runners],
        captured_inputs={name: getattr(inputs, name).data_ptr() for name in _TOKEN_FIELDS},
        seconds=time.perf_counter() - started,
    )


def _abandon(
    current: list[tuple[Any, Any]], pieces: list[Any], exc: BaseException
) -> BaseException:
    """End the capture in progress through its context (which cleans up after a failed capture and
    reports it as CaptureError), reset every piece, and return the error to raise."""
    error: BaseException = capture_error_of(exc) or exc
    for graph, capture in current:
        try:
            capture.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException as raised:  # the context re-raises, possibly translated
            error = capture_error_of(raised) or raised
        graph.reset()
    current.clear()
    for piece in pieces:
        piece.reset()
    return error
