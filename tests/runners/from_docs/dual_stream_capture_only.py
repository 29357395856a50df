"""An SGLang-style MoE decoder runner that overlaps its experts on two streams only while capturing.

Design (after SGLang's DeepSeek MoE, whose dual-stream forward is taken only in capture mode):
one attention layer over a slot-major paged KV cache, then a MoE block with a top-2 router
(float32) over four routed experts and one always-on shared expert. While a stream captures, the
routed experts run on an auxiliary stream, forked from the current stream
(``alt.wait_stream(current)``) and joined before the sum (``current.wait_stream(alt)``), and the
shared expert runs on the current stream beside them. Eagerly, and in the warm-up before each
capture, everything runs on the current stream, one expert after the other. Uniform one-token
decode steps replay FULL graphs captured at start-up for padded request counts (largest first,
one shared pool); everything else (prefill, mixed batches, batches past the largest graph) runs
eagerly. The model, the graphs and the contract are `shared_expert_stream_inplace`'s; only the
MoE block's streams differ.

The bug (``make_buggy_target``): the shared expert writes its output into the MoE input
``hidden_states`` in place (the input's memory reused for the output), while the routed experts
on the auxiliary stream still read that tensor. Nothing inside the graph orders the routed experts' read before
the in-place write, so a replay's routed experts may read the shared expert's sum instead of
their input. Eager steps and the warm-ups run one stream and are correct; only the captured
graphs race. The fix writes the shared expert's output to a fresh tensor.
Source: the in-place race of vLLM PR https://github.com/vllm-project/vllm/pull/28430 ("clone
the hidden states before stream to avoid race condition"), placed in the capture-only dual-stream
path of SGLang's ``DeepseekV2MoE.forward_normal_dual_stream`` (taken when
``get_is_capture_mode()``), where the two streams meet only inside the graphs.
"""

from __future__ import annotations

from typing import Literal

import torch

from tests.runners.from_docs.shared_expert_stream_inplace import SharedExpertMoERunner


class DualStreamMoERunner(SharedExpertMoERunner):
    def __init__(self, mode: str, *, seed: int, backend: str, shared_in_place: bool) -> None:
        self.shared_in_place = shared_in_place  # before the graphs are captured, at start-up
        super().__init__(mode, seed=seed, backend=backend, clone_input=False)

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        if not self.be.is_current_stream_capturing():
            return self._routed(h) + self._shared(h)
        cur = self.be.current_stream()
        self.aux.wait_stream(cur)
        with self.be.stream(self.aux):
            routed = self._routed(h)
        shared = self._shared(h)
        cur.wait_stream(self.aux)
        return routed + shared

    def _shared(self, h: torch.Tensor) -> torch.Tensor:
        out = self._shared_expert(h)
        if self.shared_in_place:
            return h.copy_(out)  # the input's memory reused for the output
        return out


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DualStreamMoERunner:
    return DualStreamMoERunner(mode, seed=seed, backend=backend, shared_in_place=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> DualStreamMoERunner:
    return DualStreamMoERunner(mode, seed=seed, backend=backend, shared_in_place=True)
