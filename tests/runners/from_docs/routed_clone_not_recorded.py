"""An SGLang-style MoE decoder runner whose routed experts read a clone of their input on a side
stream, only while capturing.

Design: `dual_stream_capture_only`'s model, graphs and streams (the routed experts on an
auxiliary stream while a stream captures, the shared expert on the current one beside them, one
stream eagerly and in the warm-ups), with that runner's fix for the in-place race turned the other
way round: the shared expert keeps writing its output into the MoE input in place, and the routed
experts read a clone of the input instead, made on the current stream by the helper that forks
the auxiliary stream. The helper returns the routed output; the clone dies with it, before the
current stream joins the auxiliary one.

The bug (``make_buggy_target``): the helper lets go of the clone without
``routed_in.record_stream(aux)``. Inside a capture CUDA's caching allocator gives a freed block
back to its stream at once, so the current stream's next allocation of the clone's size (the
shared expert's) is handed the clone's block and writes it while the routed experts, on the
other branch of the graph, may still read it. The fix records the clone on the auxiliary stream,
which keeps its block from every allocation until the capture ends.
Source: the second half of vLLM PR https://github.com/vllm-project/vllm/pull/28430 ("[Bugfix] Fix
Stream Sync for Shared Expert Overlap": after cloning the hidden states for the side stream, it
calls ``record_stream`` on the clone so that garbage collection cannot give its memory away); the
same missing ``record_stream`` on a tensor shared between the MoE's streams came back in a fork of
vLLM (https://github.com/local-inference-lab/vllm/pull/93, where a shared-expert output's
allocation was recycled while the main stream still consumed it and graph capture faulted).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tests.runners.from_docs.dual_stream_capture_only import DualStreamMoERunner


class ClonedRoutedInputRunner(DualStreamMoERunner):
    def __init__(self, mode: str, *, seed: int, backend: str, record_clone: bool) -> None:
        self.record_clone = record_clone
        super().__init__(mode, seed=seed, backend=backend, shared_in_place=True)

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        if not self.be.is_current_stream_capturing():
            return self._routed(h) + self._shared(h)  # the routed experts read h first
        cur = self.be.current_stream()
        routed = self._routed_on_aux(h, cur)
        shared = self._shared(h)  # writes h in place: the routed experts read their clone
        cur.wait_stream(self.aux)
        return routed + shared

    def _routed_on_aux(self, h: torch.Tensor, cur: Any) -> torch.Tensor:
        """The routed experts on the auxiliary stream, over a clone of `h`; their output."""
        routed_in = h.clone()
        self.aux.wait_stream(cur)
        with self.be.stream(self.aux):
            routed = self._routed(routed_in)
        if self.record_clone:
            routed_in.record_stream(self.aux)
        return routed  # the clone dies here, before the current stream joins the auxiliary one


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ClonedRoutedInputRunner:
    return ClonedRoutedInputRunner(mode, seed=seed, backend=backend, record_clone=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ClonedRoutedInputRunner:
    return ClonedRoutedInputRunner(mode, seed=seed, backend=backend, record_clone=False)
