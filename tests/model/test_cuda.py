"""On a GPU: the same decoder and samples as on the CPU, and a captured step replays correctly."""

import pytest
import torch

from pytest_graphmode import Request
from pytest_graphmode.runtime.model import (
    Decoder,
    DecoderConfig,
    make_inputs,
    reference_forward,
    sample,
)
from tests.model.model_scenarios import CONFIG, fresh_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _decode_batch(offset: int) -> list[Request]:
    """Four requests decoding at position 5 + offset over the 7 tokens `_fill` cached."""
    return [
        Request(
            req_id=i,
            tokens=(7 * i + offset,),
            context_len=5 + offset,
            block_ids=(2 * i + 1, 2 * i + 2),
        )
        for i in range(4)
    ]


def _fill(decoder: Decoder) -> None:
    history = [
        Request(
            req_id=i, tokens=tuple(range(i, i + 7)), context_len=0, block_ids=(2 * i + 1, 2 * i + 2)
        )
        for i in range(4)
    ]
    decoder.forward(make_inputs(decoder.config, history, device=decoder.device))


def test_cuda_forward_matches_cpu() -> None:
    cpu, gpu = fresh_decoder(), Decoder(CONFIG, seed=0, device="cuda")
    for decoder in (cpu, gpu):
        _fill(decoder)
    cpu_logits = cpu.forward(make_inputs(CONFIG, _decode_batch(0), device="cpu"))
    gpu_logits = gpu.forward(make_inputs(CONFIG, _decode_batch(0), device="cuda"))
    torch.testing.assert_close(gpu_logits.cpu(), cpu_logits, atol=1e-4, rtol=1e-4)


def test_cuda_samples_equal_cpu_samples() -> None:
    logits = torch.randn(64, CONFIG.vocab_size, generator=torch.Generator().manual_seed(0)) * 2
    seeds = torch.arange(64) * 1_000_003 - 1
    temperatures = torch.full((64,), 0.8)
    positions = torch.arange(64) * 17
    on_cpu = sample(logits, seeds, temperatures, positions)
    on_gpu = sample(logits.cuda(), seeds.cuda(), temperatures.cuda(), positions.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_captured_step_replays_other_contents_like_eager() -> None:
    decoder = Decoder(CONFIG, seed=0, device="cuda")
    _fill(decoder)
    static = make_inputs(CONFIG, _decode_batch(0), device="cuda", num_tokens=6, num_reqs=6)
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        decoder.forward(static)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = decoder.forward(static)

    fresh = make_inputs(CONFIG, _decode_batch(1), device="cuda", num_tokens=6, num_reqs=6)
    cache = decoder.kv_cache.clone()
    expected = decoder.forward(fresh)
    decoder.kv_cache.copy_(cache)
    for name, tensor in static.tensors().items():
        tensor.copy_(fresh.tensors()[name])
    graph.replay()
    torch.testing.assert_close(static_logits[:4], expected[:4], atol=1e-5, rtol=1e-5)


def test_gpu_bench_config_matches_reference_in_bfloat16() -> None:
    config = DecoderConfig.gpu_bench()
    decoder = Decoder(config, seed=0, device="cuda")
    requests = [
        Request(req_id=i, tokens=tuple(range(i, i + 20)), context_len=0, block_ids=(i + 1, i + 100))
        for i in range(8)
    ]
    logits = decoder.forward(make_inputs(config, requests, device="cuda"))
    expected = reference_forward(config, decoder.weights(), [r.tokens for r in requests])
    torch.testing.assert_close(logits.cpu(), expected, atol=0.25, rtol=0.05)
