"""What a user sees for input the runtime cannot run: one clear ValueError, raised before anything
is written, and inputs a user would expect to work (numpy numbers, a bare `cuda`) working."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from runtime_helpers import TINY, assert_match, make_batch

from pytest_graphmode import Batch, Request
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.model import Decoder
from pytest_graphmode.runtime.target import RuntimeTarget, make_target

np = pytest.importorskip("numpy")

BATCH = make_batch([1, 1], context=3, seeds=[4, 5])


def _snapshot(target: RuntimeTarget) -> dict[str, torch.Tensor]:
    tensors = {**target.static_buffers(), **target.state()}
    return {name: t.clone() for name, t in tensors.items()}


def _assert_unchanged(before: dict[str, torch.Tensor], target: RuntimeTarget) -> None:
    after = {**target.static_buffers(), **target.state()}
    for name, old in before.items():
        assert torch.equal(old.view(torch.uint8), after[name].view(torch.uint8)), f"{name} changed"


def _numpy(request: Request, **changes: Any) -> Request:
    return dataclasses.replace(
        request,
        tokens=tuple(np.int64(t) for t in request.tokens),
        context_len=np.int32(request.context_len),
        block_ids=tuple(np.int64(b) for b in request.block_ids),
        seed=None if request.seed is None else np.uint32(request.seed),
        **changes,
    )


def test_numpy_integers_and_a_float32_temperature_run_like_python_numbers() -> None:
    plain = dataclasses.replace(
        BATCH, requests=tuple(dataclasses.replace(r, temperature=0.5) for r in BATCH.requests)
    )
    numpy = Batch(tuple(_numpy(r, temperature=np.float32(0.5)) for r in BATCH.requests))
    first, second = (make_target("graph", seed=3, backend="sim") for _ in range(2))
    assert_match(first.step(numpy), second.step(plain))
    assert torch.equal(first.state()["kv_cache"], second.state()["kv_cache"])


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        pytest.param(Batch(("not a request",)), "row 0 is a str, not a Request", id="stranger"),  # type: ignore[arg-type]
        pytest.param([BATCH.requests[0]], "expected a Batch, got list", id="list"),
        pytest.param(
            Batch((Request(req_id=7, tokens=(), context_len=3, block_ids=(1,)),)),
            r"request 7 \(row 0\): has no query tokens",
            id="empty-query",
        ),
        pytest.param(
            Batch((dataclasses.replace(BATCH.requests[0], temperature=True),)),
            "temperature=True must be a finite real number > 0",
            id="bool-temperature",
        ),
    ],
)
def test_malformed_input_gets_a_value_error_naming_it_and_changes_nothing(
    batch: Any, message: str
) -> None:
    target = make_target("graph", seed=1, backend="sim")
    target.step(BATCH)  # a captured graph and non-trivial buffers
    before = _snapshot(target)
    with pytest.raises(ValueError, match=message):
        target.step(batch)
    _assert_unchanged(before, target)
    graphs = target.executor.graphs
    assert target.step(BATCH).path == "full"
    assert target.executor.graphs == graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="a bare cuda names the GPU, not the sim")
def test_a_decoder_on_bare_cuda_runs_on_the_sim_backend(sim: Any) -> None:
    decoder = Decoder(TINY, seed=1, device="cuda")
    executor = GraphExecutor(decoder, sim, capture_sizes=[1, 2])
    assert executor.step(make_batch([1])).path == "full"


def test_a_decoder_on_the_host_is_refused_by_the_sim_backend(sim: Any) -> None:
    decoder = Decoder(TINY, seed=1, device="cpu:0")
    with pytest.raises(ValueError, match=r"device=backend\.device"):
        GraphExecutor(decoder, sim, capture_sizes=[1, 2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_decoder_on_bare_cuda_runs_on_the_cuda_backend() -> None:
    from pytest_graphmode.runtime import backends

    decoder = Decoder(TINY, seed=1, device="cuda")
    GraphExecutor(decoder, backends.get("cuda"), capture_sizes=[1]).close()


def test_update_weights_after_close_is_refused() -> None:
    target = make_target("graph", seed=1, backend="sim")
    target.close()
    with pytest.raises(RuntimeError, match="closed"):
        target.update_weights(2)


def test_the_eager_twin_has_no_static_buffers() -> None:
    assert make_target("eager", seed=1, backend="sim").static_buffers() == {}
