from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime.memory import (
    HostView,
    PoolError,
    VmmUnsupportedError,
    find_overlaps,
    make_graph_memory,
)

from .conftest import GRANULARITY


@dataclass
class _Handle:
    reserved_bytes: int


class _SimLikeBackend:
    """The two members of the backend facade the strategies use, as the sim backend has them."""

    def __init__(self, name: str = "sim") -> None:
        self.name = name
        self.handles: list[_Handle] = []

    def graph_pool_handle(self) -> _Handle:
        self.handles.append(_Handle(reserved_bytes=1000 * (len(self.handles) + 1)))
        return self.handles[-1]


def test_separate_gives_each_graph_a_fresh_pool():
    memory = make_graph_memory("separate", _SimLikeBackend())
    assert memory.pool_for("a") is not memory.pool_for("b")


def test_shared_gives_every_graph_the_same_pool():
    memory = make_graph_memory("shared", _SimLikeBackend())
    assert memory.pool_for("a") is memory.pool_for("b")


def test_separate_stats_sum_the_reserved_bytes_of_every_pool():
    memory = make_graph_memory("separate", _SimLikeBackend())
    for key in "abc":
        memory.pool_for(key)
        memory.captured(key)
    assert memory.stats().physical_bytes == 1000 + 2000 + 3000
    assert memory.stats().views == 3


def test_shared_stats_count_the_one_pool_once():
    memory = make_graph_memory("shared", _SimLikeBackend())
    for key in "abc":
        memory.pool_for(key)
    assert memory.stats().physical_bytes == 1000
    assert memory.stats().views == 3


def test_handle_strategies_track_no_address_views():
    memory = make_graph_memory("separate", _SimLikeBackend())
    memory.pool_for("a")
    assert memory.views() == []


def test_a_discarded_separate_pool_no_longer_counts():
    memory = make_graph_memory("separate", _SimLikeBackend())
    memory.pool_for("a")
    memory.pool_for("b")
    memory.discard("a")
    assert memory.stats().physical_bytes == 2000


def test_sim_handles_without_reserved_bytes_are_reported():
    backend = _SimLikeBackend()
    backend.graph_pool_handle = object  # type: ignore[method-assign]
    memory = make_graph_memory("shared", backend)
    memory.pool_for("a")
    with pytest.raises(PoolError, match="reserved_bytes"):
        memory.stats()


@pytest.mark.parametrize("strategy", ["separate", "shared", "vmm"])
def test_a_key_gets_one_pool_until_it_is_discarded(strategy):
    memory = make_graph_memory(strategy, _SimLikeBackend())
    memory.pool_for("k")
    with pytest.raises(PoolError, match="already has"):
        memory.pool_for("k")
    memory.discard("k")
    memory.pool_for("k")
    memory.close()


@pytest.mark.parametrize("strategy", ["separate", "shared", "vmm"])
def test_captured_needs_a_pool_first(strategy):
    memory = make_graph_memory(strategy, _SimLikeBackend())
    with pytest.raises(KeyError, match="'k'"):
        memory.captured("k")
    memory.close()


def test_unknown_strategy_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="'separate', 'shared', 'vmm'"):
        make_graph_memory("pooled", _SimLikeBackend())


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="expected 'sim' or 'cuda'"):
        make_graph_memory("vmm", _SimLikeBackend("rocm"))


def test_granularity_applies_to_vmm_only():
    with pytest.raises(ValueError, match="vmm strategy only"):
        make_graph_memory("shared", _SimLikeBackend(), granularity=GRANULARITY)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_vmm_on_cuda_without_cuda_says_why():
    with pytest.raises(VmmUnsupportedError) as raised:
        make_graph_memory("vmm", _SimLikeBackend("cuda"))
    assert "CUDA is not available" in raised.value.reason


def test_vmm_on_sim_hands_out_a_fresh_host_view_per_capture():
    memory = make_graph_memory("vmm", _SimLikeBackend(), granularity=GRANULARITY)
    first, second = memory.pool_for("a"), memory.pool_for("b")
    assert isinstance(first, HostView) and isinstance(second, HostView)
    assert first.base != second.base
    memory.close()


def test_vmm_captured_seals_the_view():
    memory = make_graph_memory("vmm", _SimLikeBackend(), granularity=GRANULARITY)
    view = memory.pool_for("a")
    assert isinstance(view, HostView)
    view.allocate(100)
    memory.captured("a")
    with pytest.raises(PoolError, match="has ended"):
        view.allocate(100)
    memory.close()


def test_vmm_discard_drops_the_view_from_the_ledger():
    memory = make_graph_memory("vmm", _SimLikeBackend(), granularity=GRANULARITY)
    memory.pool_for("a").allocate(100)  # type: ignore[attr-defined]
    memory.pool_for("b").allocate(100)  # type: ignore[attr-defined]
    memory.discard("a")
    assert [view.graph_key for view in memory.views()] == ["b"]
    assert memory.stats().views == 1
    memory.close()


@given(st.permutations([1, 2, 4, 8, 16]))
def test_vmm_physical_bytes_follow_the_largest_capture_not_the_sum(order):
    memory = make_graph_memory("vmm", _SimLikeBackend(), granularity=GRANULARITY)
    for size in order:
        view = memory.pool_for(size)
        assert isinstance(view, HostView)
        view.allocate(size * GRANULARITY)
        view.allocate(100)
        memory.captured(size)
    stats = memory.stats()
    memory.close()
    assert stats.physical_bytes == 17 * GRANULARITY
    assert stats.virtual_bytes == sum(size + 1 for size in order) * GRANULARITY
    assert find_overlaps(memory.views()) == []
