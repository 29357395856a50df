"""`load_factory` and `check_target`: every problem named, with what to do about it."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from pytest_graphmode.loader import TargetError, check_target, check_twins, load_factory
from tests.plugin.toy_target import SPEC, ToyTarget, make_target


def test_load_factory_returns_the_named_callable() -> None:
    assert load_factory("tests.plugin.toy_target:make_target") is make_target


def test_load_factory_follows_dotted_attributes() -> None:
    assert load_factory("tests.plugin.toy_target:ToyTarget.step") is ToyTarget.step


@pytest.mark.parametrize("spec", ["no_colon", ":make_target", "module:", "a:b:c"])
def test_load_factory_rejects_a_name_without_module_and_factory(spec: str) -> None:
    with pytest.raises(TargetError, match="not of the form 'module:factory'"):
        load_factory(spec)


def test_load_factory_reports_the_import_error() -> None:
    with pytest.raises(TargetError, match=r"cannot import module 'no_such_module_xyz'.*No module"):
        load_factory("no_such_module_xyz:make_target")


def test_load_factory_lists_public_names_when_the_attribute_is_missing() -> None:
    with pytest.raises(TargetError, match=r"has no attribute 'make_targte'.*make_target"):
        load_factory("tests.plugin.toy_target:make_targte")


def test_load_factory_rejects_something_not_callable() -> None:
    with pytest.raises(TargetError, match="is a TargetSpec, not callable"):
        load_factory("tests.plugin.toy_target:SPEC")


def test_check_target_accepts_a_conforming_target() -> None:
    check_target(make_target("graph", seed=0, backend="sim"))


def test_check_target_names_every_missing_method() -> None:
    class Partial:
        spec = SPEC

        def step(self) -> None: ...

    with pytest.raises(TargetError, match=r"state\(\) missing.*close\(\) missing"):
        check_target(Partial())


def test_check_target_rejects_a_spec_of_the_wrong_type() -> None:
    target = make_target("graph", seed=0, backend="sim")
    target.spec = dataclasses.asdict(SPEC)  # type: ignore[assignment]
    with pytest.raises(TargetError, match=r"`spec` is a dict, not a pytest_graphmode\.TargetSpec"):
        check_target(target)


def test_check_target_reports_an_inconsistent_spec() -> None:
    target = make_target("graph", seed=0, backend="sim")
    broken = dataclasses.replace(SPEC)
    object.__setattr__(broken, "null_block", SPEC.num_blocks)
    target.spec = broken
    with pytest.raises(TargetError, match="spec: null_block=16 outside"):
        check_target(target)


class _WithExtraState(ToyTarget):
    """The toy with one more `state()` tensor, `extra`."""

    def __init__(self, mode: str, seed: int, extra: torch.Tensor) -> None:
        super().__init__(mode, seed, logit_offset=0.0)
        self.extra = extra

    def state(self) -> Mapping[str, torch.Tensor]:
        return {**super().state(), "extra": self.extra}


def _twins_with(extra: Callable[[], torch.Tensor]) -> Any:
    def make(mode: str, *, seed: int, backend: str) -> _WithExtraState:
        return _WithExtraState(mode, seed, extra())

    return make


def test_check_twins_takes_a_state_kept_per_block_beside_the_cache() -> None:
    check_twins(_twins_with(lambda: torch.zeros(SPEC.num_blocks, 3)), seed=0, backend="sim")


def test_check_twins_refuses_a_tensor_laid_out_per_block_and_slot() -> None:
    unflattened = (SPEC.num_blocks, SPEC.block_size, 2)
    with pytest.raises(TargetError, match=r"state\(\)\['extra'\] has shape .* one row per block"):
        check_twins(_twins_with(lambda: torch.zeros(unflattened)), seed=0, backend="sim")
