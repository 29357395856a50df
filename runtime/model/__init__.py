"""The reference decoder: a Llama-like model over a paged KV cache, with graph-safe sampling.

`Decoder.forward` and `sample` issue no host reads and have no data-dependent shapes, so a whole
step captures into one CUDA graph; `paged_attention` is a separate callable so a piecewise runner
can run it eagerly between graph pieces. `reference_forward` is the dense oracle for tests.
"""

from pytest_graphmode.runtime.model.attention import AttentionFn, paged_attention
from pytest_graphmode.runtime.model.config import DecoderConfig
from pytest_graphmode.runtime.model.decoder import Decoder
from pytest_graphmode.runtime.model.inputs import (
    PAD_ADAPTER,
    PAD_POSITION,
    PAD_SLOT,
    PAD_TOKEN,
    SEQ_LEN_FILL,
    DecoderInputs,
    input_spec,
    make_inputs,
    token_requests,
)
from pytest_graphmode.runtime.model.reference import reference_forward
from pytest_graphmode.runtime.model.sampler import sample
from pytest_graphmode.runtime.model.weights import init_weights, weight_shapes

__all__ = [
    "PAD_ADAPTER",
    "PAD_POSITION",
    "PAD_SLOT",
    "PAD_TOKEN",
    "SEQ_LEN_FILL",
    "AttentionFn",
    "Decoder",
    "DecoderConfig",
    "DecoderInputs",
    "init_weights",
    "input_spec",
    "make_inputs",
    "paged_attention",
    "reference_forward",
    "sample",
    "token_requests",
    "weight_shapes",
]
