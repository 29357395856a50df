import gc
import itertools
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime.memory import (
    HostPool,
    PoolError,
    PoolExhaustedError,
    find_overlaps,
)

from .conftest import GRANULARITY, VIEW_CAPACITY, fd_count, mapping_count

sizes = st.lists(st.integers(0, 40_000), min_size=1, max_size=6)


@given(st.lists(sizes, min_size=2, max_size=5))
def test_views_of_different_graphs_are_disjoint(shapes):
    with HostPool(GRANULARITY, VIEW_CAPACITY) as pool:
        blocks = {}
        for key, shape in enumerate(shapes):
            view = pool.new_view(key)
            blocks[key] = [view.allocate(n) for n in shape]
        assert find_overlaps(pool.views()) == []
        for key, view_blocks in blocks.items():
            view = pool.views()[key]
            for block in view_blocks:
                start = block.untyped_storage().data_ptr()
                assert view.base <= start <= start + block.numel() <= view.end


def test_a_write_through_one_view_is_visible_through_another(pool):
    first = pool.new_view("small").allocate(3000)
    second = pool.new_view("large").allocate(3000)
    assert first.data_ptr() != second.data_ptr()
    first.copy_(torch.arange(3000) % 251)
    assert torch.equal(second, first)
    second[1234] = 7
    assert first[1234].item() == 7


def test_a_block_is_exactly_the_requested_size_and_256_byte_aligned(pool):
    view = pool.new_view("k")
    for nbytes in (1, 255, 4097, 0, 100_000):
        block = view.allocate(nbytes)
        assert block.dtype == torch.uint8
        assert block.numel() == nbytes
        assert block.untyped_storage().data_ptr() % 256 == 0


def test_zero_byte_blocks_get_distinct_addresses(pool):
    view = pool.new_view("k")
    first, second = view.allocate(0), view.allocate(0)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()


def test_blocks_can_be_carved_into_typed_tensors(pool):
    block = pool.new_view("k").allocate(4 * 16)
    floats = block.view(torch.float32).view(4, 4)
    floats.fill_(1.5)
    assert floats.sum().item() == 24.0


def _capture_alone(shape: list[int]) -> int:
    with HostPool(GRANULARITY, VIEW_CAPACITY) as alone:
        _capture(alone, "alone", shape)
        return alone.stats().physical_bytes


def _capture(pool: HostPool, key: object, shape: list[int]) -> None:
    """What a capture does to its pool: allocate blocks and free some of them again."""
    view = pool.new_view(key)
    blocks = [view.allocate(n) for n in shape]
    for block in blocks[::2]:
        view.release(block)
    view.seal()


def _check_physical_is_the_largest_single_capture(shapes: list[list[int]], order: list[int]):
    needs = [_capture_alone(shape) for shape in shapes]
    with HostPool(GRANULARITY, VIEW_CAPACITY) as pool:
        for index in order:
            _capture(pool, index, shapes[index])
        stats = pool.stats()
    assert stats.physical_bytes == max(needs)
    assert stats.views == len(shapes)
    assert stats.virtual_bytes == sum(needs)
    largest = max(shapes, key=lambda shape: sum(shape))
    assert sum(largest) <= stats.physical_bytes < sum(largest) + 256 * len(largest) + GRANULARITY


def _shape(size: int) -> list[int]:
    """Blocks of a capture at batch size `size`: activations, logits, a workspace."""
    return [size * 1024, size * 300 + 17, size * 4096]


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_physical_bytes_are_the_largest_capture_in_sorted_order(order):
    sizes = [1, 2, 4, 8, 16]
    shapes = [_shape(size) for size in sizes]
    indices = list(range(len(sizes)))
    _check_physical_is_the_largest_single_capture(
        shapes, indices if order == "ascending" else indices[::-1]
    )


@given(st.permutations(range(6)))
def test_physical_bytes_are_the_largest_capture_in_any_order(order):
    shapes = [_shape(size) for size in (1, 3, 5, 8, 12, 16)]
    _check_physical_is_the_largest_single_capture(shapes, order)


@given(st.lists(sizes, min_size=1, max_size=5), st.randoms())
def test_physical_bytes_are_the_largest_capture_for_any_allocations(shapes, random):
    order = list(range(len(shapes)))
    random.shuffle(order)
    _check_physical_is_the_largest_single_capture(shapes, order)


def test_physical_pool_file_has_the_accounted_size(pool):
    pool.new_view("k").allocate(3 * GRANULARITY + 1)
    assert pool.stats().physical_bytes == 4 * GRANULARITY
    assert os.fstat(pool._require_open()).st_size == 4 * GRANULARITY


def test_a_sealed_view_refuses_allocations(pool):
    view = pool.new_view("k")
    view.seal()
    with pytest.raises(PoolError, match="capture of graph 'k' has ended"):
        view.allocate(16)


def test_allocating_beyond_the_view_capacity_fails_before_mapping_anything(pool):
    view = pool.new_view("k")
    with pytest.raises(PoolExhaustedError, match="larger view_capacity"):
        view.allocate(VIEW_CAPACITY + 1)
    assert pool.stats().physical_bytes == 0
    assert view.mapped_bytes == 0


def test_a_negative_size_is_rejected(pool):
    with pytest.raises(ValueError, match="must be >= 0"):
        pool.new_view("k").allocate(-1)


def test_releasing_a_block_of_another_view_is_an_error(pool):
    foreign = pool.new_view("a").allocate(64)
    with pytest.raises(PoolError, match="not a live block of the view of graph 'b'"):
        pool.new_view("b").release(foreign)


def test_a_key_gets_one_view_until_it_is_discarded(pool):
    pool.new_view("k")
    with pytest.raises(PoolError, match="already has a view"):
        pool.new_view("k")
    pool.discard("k")
    assert pool.new_view("k").key == "k"


@pytest.mark.parametrize("granularity", [0, 1000, -4096])
def test_granularity_must_be_a_positive_multiple_of_the_page_size(granularity):
    with pytest.raises(ValueError, match="multiple of the page size"):
        HostPool(granularity)


def test_discarding_keeps_the_physical_size_and_drops_the_view(pool):
    pool.new_view("k").allocate(GRANULARITY)
    pool.discard("k")
    assert pool.stats().physical_bytes == GRANULARITY
    assert pool.views() == []


def test_close_releases_every_mapping_and_descriptor_twenty_times():
    HostPool(GRANULARITY, VIEW_CAPACITY).close()  # first use loads libc and torch paths
    gc.collect()
    maps_before, fds_before = mapping_count(), fd_count()
    for _ in range(20):
        pool = HostPool(GRANULARITY, VIEW_CAPACITY)
        for key in range(3):
            view = pool.new_view(key)
            blocks = [view.allocate(n) for n in (1000, 3 * GRANULARITY)]
            blocks[0].fill_(key)
        assert mapping_count() > maps_before
        del view, blocks
        pool.close()
        assert pool.stats().physical_bytes == 0
        assert pool.views() == []
    assert (mapping_count(), fd_count()) == (maps_before, fds_before)


def test_a_pool_dropped_without_close_gives_back_its_descriptor():
    HostPool(GRANULARITY, VIEW_CAPACITY).close()
    gc.collect()
    fds_before = fd_count()
    for _ in range(5):
        pool = HostPool(GRANULARITY, VIEW_CAPACITY)
        pool.new_view("k").allocate(1000).fill_(1)
        del pool
    gc.collect()
    assert fd_count() == fds_before


def test_a_tensor_alive_at_close_keeps_its_mapping_until_it_dies():
    maps_before = mapping_count()
    pool = HostPool(GRANULARITY, VIEW_CAPACITY)
    block = pool.new_view("k").allocate(1000)
    block.fill_(3)
    floats = block[:400].view(torch.float32)
    del block
    pool.close()
    assert mapping_count() > maps_before
    assert torch.equal(floats.view(torch.uint8), torch.full((400,), 3, dtype=torch.uint8))
    del floats
    assert mapping_count() == maps_before


def test_a_closed_pool_refuses_new_views_and_allocations():
    pool = HostPool(GRANULARITY, VIEW_CAPACITY)
    view = pool.new_view("k")
    pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.new_view("other")
    with pytest.raises(PoolError, match="closed"):
        view.allocate(16)


def test_a_released_block_is_reused_by_the_next_allocation_that_fits(pool):
    view = pool.new_view("k")
    first = view.allocate(1000)
    view.allocate(1000)
    address = first.data_ptr()
    view.release(first)
    assert view.allocate(700).data_ptr() == address


def test_adjacent_released_blocks_merge_into_one_hole(pool):
    view = pool.new_view("k")
    blocks = [view.allocate(512) for _ in range(3)]
    view.allocate(512)
    view.release(blocks[0])
    view.release(blocks[1])
    view.release(blocks[2])
    assert view.allocate(3 * 512).data_ptr() == blocks[0].data_ptr()


def test_releasing_the_top_block_lowers_the_views_need(pool):
    view = pool.new_view("k")
    view.allocate(GRANULARITY)
    top = view.allocate(GRANULARITY)
    view.release(top)
    view.allocate(GRANULARITY)
    assert pool.stats().physical_bytes == 2 * GRANULARITY


def test_releasing_a_block_twice_is_an_error(pool):
    view = pool.new_view("k")
    block = view.allocate(100)
    view.allocate(100)
    view.release(block)
    with pytest.raises(PoolError, match="released twice"):
        view.release(block)


operations = st.lists(st.tuples(st.booleans(), st.integers(0, 5000), st.integers(0, 99)))


@given(operations)
def test_live_blocks_never_share_a_byte(ops):
    with HostPool(GRANULARITY, VIEW_CAPACITY) as pool:
        view = pool.new_view("k")
        live: list[torch.Tensor] = []
        for allocate, nbytes, pick in ops:
            if allocate or not live:
                live.append(view.allocate(nbytes))
            else:
                view.release(live.pop(pick % len(live)))
            ranges = sorted(
                (b.untyped_storage().data_ptr(), b.untyped_storage().data_ptr() + b.numel())
                for b in live
            )
            assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges))
