"""Nothing in a step reads device values back to the host or lets them choose shapes or ops,
which is what makes a whole step capturable into one graph and replayable with other contents."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_graphmode.runtime.model import make_inputs, sample
from tests.model.model_scenarios import CONFIG, Scenario, fresh_decoder, prepare, scenarios

HOST_READS = {
    torch.ops.aten._local_scalar_dense,
    torch.ops.aten.nonzero,
    torch.ops.aten.equal,
    torch.ops.aten.is_nonzero,
}


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in HOST_READS:
            raise AssertionError(f"host read {func} would break graph capture")
        return func(*args, **(kwargs or {}))


class _OpTrace(TorchDispatchMode):
    """Every op issued, with its output shapes: what a capture would freeze."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else [out]
        shapes = [tuple(o.shape) for o in outputs if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), shapes))
        return out


@pytest.mark.parametrize("use_adapters", [False, True], ids=["base", "adapters"])
@given(scenario=scenarios("mixed", adapters=True))
def test_forward_issues_no_host_reads(use_adapters: bool, scenario: Scenario) -> None:
    decoder = fresh_decoder()
    inputs = prepare(decoder, scenario, use_adapters=use_adapters)
    with _NoHostReads():
        decoder.forward(inputs, use_adapters=use_adapters)


def test_sample_issues_no_host_reads() -> None:
    logits = torch.randn(3, CONFIG.vocab_size)
    with _NoHostReads():
        sample(logits, torch.tensor([-1, 0, 9]), torch.tensor([1.0, 0.5, 0.0]), torch.arange(3))


def _trace(run: Callable[..., object], *args: Any, **kwargs: Any) -> list[Any]:
    with _OpTrace() as trace:
        run(*args, **kwargs)
    return trace.ops


@given(first=scenarios("mixed", adapters=True), second=scenarios("mixed", adapters=True))
def test_batches_of_equal_row_counts_issue_identical_ops(first: Scenario, second: Scenario) -> None:
    num_tokens = max(first.num_tokens, second.num_tokens) + 1
    traces = []
    for scenario in (first, second):
        decoder = fresh_decoder()
        prepare(decoder, scenario, use_adapters=True)
        inputs = make_inputs(
            CONFIG, scenario.step_requests(), device="cpu", num_tokens=num_tokens, num_reqs=6
        )
        traces.append(_trace(decoder.forward, inputs, use_adapters=True))
    assert traces[0] == traces[1]
