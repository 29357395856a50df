"""Engine schedules rebuilt at a given maximum size, and the align / clamp options."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime.buckets import KINDS, schedule


def test_vllm_default_at_512_has_51_sizes_in_three_runs():
    sizes = schedule("vllm", 512)
    assert len(sizes) == 51
    assert sizes[:4] == [1, 2, 4, 8]
    assert sizes[3:34] == list(range(8, 256, 8))
    assert sizes[34:] == list(range(256, 513, 16))


def test_deepinfer_is_powers_of_two_then_interval_multiples_then_max():
    assert schedule("deepinfer", 256) == [1, 2, 4, *range(8, 256, 8), 256]
    assert len(schedule("deepinfer", 256)) == 35
    assert schedule("deepinfer", 100, interval=32) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_nanovllm_is_small_powers_then_steps_of_16():
    assert schedule("nanovllm", 64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_sglang_default_list_switches_step_at_256_and_512():
    sizes = schedule("sglang", 640)
    assert sizes[:6] == [1, 2, 4, 8, 12, 16]
    assert 264 not in sizes and 272 in sizes and 496 in sizes
    assert sizes[-5:] == [512, 544, 576, 608, 640]


def test_pow2_ends_at_first_power_covering_max_unless_clamped():
    assert schedule("pow2", 300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert schedule("pow2", 300, clamp=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]


def test_explicit_list_is_sorted_and_deduplicated():
    assert schedule([8, 1, 8, 4], 8) == [1, 4, 8]


def test_explicit_list_above_max_needs_clamp():
    with pytest.raises(ValueError, match="clamp=True"):
        schedule([1, 64, 128], 100)
    assert schedule([1, 64, 128], 100, clamp=True) == [1, 64, 100]


def test_align_keeps_only_multiples_and_the_largest_size():
    assert schedule("vllm", 500, align=16, clamp=True)[:3] == [16, 32, 48]
    assert schedule("vllm", 500, align=16, clamp=True)[-2:] == [496, 500]


def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match="vllm"):
        schedule("trtllm", 64)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_max_size_is_rejected(bad):
    with pytest.raises(ValueError, match="max_size"):
        schedule("vllm", bad)


def test_bad_explicit_size_is_rejected():
    with pytest.raises(ValueError, match="positive int"):
        schedule([1, 0, 4], 4)


@given(kind=st.sampled_from(KINDS), max_size=st.integers(1, 2048), align=st.integers(1, 64))
def test_clamped_schedules_are_sorted_and_end_at_max(kind, max_size, align):
    sizes = schedule(kind, max_size, align=align, clamp=True)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == max_size
    assert all(s % align == 0 for s in sizes[:-1])
