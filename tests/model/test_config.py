"""Configs and step inputs that the decoder cannot run are refused with a message that says why."""

import dataclasses
import re
from collections.abc import Callable

import pytest

from pytest_graphmode import Request
from pytest_graphmode.runtime.model import DecoderConfig, make_inputs
from tests.model.model_scenarios import CONFIG


@pytest.mark.parametrize("factory", [DecoderConfig.tiny, DecoderConfig.gpu_bench])
def test_presets_build_a_decoder_config(factory: Callable[[], DecoderConfig]) -> None:
    assert isinstance(factory(), DecoderConfig)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden": 0}, "hidden=0 must be an int >= 1"),
        ({"layers": -1}, "layers=-1 must be an int >= 1"),
        ({"num_blocks": 1}, "num_blocks=1 must be >= 2"),
        ({"num_adapters": -1}, "num_adapters=-1 must be >= 0"),
        ({"heads": 4, "kv_heads": 3}, "must be a multiple of kv_heads=3"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"dtype": "float64"}, "dtype='float64' must be one of"),
        ({"rope_theta": 0.0}, "rope_theta=0.0 must be > 0"),
        ({"null_block": 64}, "null_block=64 outside"),
        ({"max_blocks_per_req": 64}, "max_blocks_per_req=64 exceeds the 63 blocks"),
    ],
)
def test_invalid_config_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="invalid DecoderConfig: .*" + re.escape(message)):
        dataclasses.replace(CONFIG, **change)  # type: ignore[arg-type]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError, match=r"hidden=0 .*head_dim=15"):
        dataclasses.replace(CONFIG, hidden=0, head_dim=15)


def _request(**change: object) -> Request:
    fields: dict[str, object] = {
        "req_id": 0,
        "tokens": (1, 2),
        "context_len": 3,
        "block_ids": (1, 2),
    }
    return Request(**{**fields, **change})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_request(block_ids=(1,)), "block table too short: 1 blocks of 4 slots"),
        (_request(block_ids=(0, 2)), "uses the null block 0"),
        (_request(block_ids=(1, 64)), r"block ids \[64\] outside \[0, 64\)"),
        (_request(tokens=(1, 256)), r"token ids \[256\] outside the vocabulary \[0, 256\)"),
        (_request(adapter=3), r"adapter=3 outside \[0, num_adapters=2\]"),
        (_request(tokens=()), "has no query tokens"),
        (
            _request(context_len=31, block_ids=tuple(range(1, 10))),
            "9 blocks exceed max_blocks_per_req=8",
        ),
    ],
)
def test_invalid_request_is_refused(request_: Request, message: str) -> None:
    with pytest.raises(ValueError, match=r"request 0 \(row 0\): " + message):
        make_inputs(CONFIG, [request_], device="cpu")


def test_inputs_that_do_not_fit_the_padded_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit num_reqs=1, num_tokens=1"):
        make_inputs(CONFIG, [_request()], device="cpu", num_tokens=1, num_reqs=1)
