"""The continuous-batching simulation that turns request traffic into decode batch sizes."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.planner import (
    TraceRequest,
    decode_runs,
    halves,
    read_azure_trace,
    simulate,
)

AZURE = Path(__file__).resolve().parents[3] / "shared/data/azure-llm-inference-2023"


def test_one_request_decodes_after_its_prefill_step():
    # 5 output tokens: the prefill step yields the first, four decode steps the rest.
    assert simulate([TraceRequest(0.0, 100, 5)]) == {1: 4}


def test_long_prompt_prefills_over_several_steps_then_decodes():
    histogram = simulate([TraceRequest(0.0, 5000, 3), TraceRequest(0.0, 10, 20)])
    # The short one decodes 19 steps, alone for 2 of them; the long one prefills 3 steps, then
    # decodes 2 steps beside it.
    assert histogram == {1: 17, 2: 2}


def test_decode_runs_come_in_step_order():
    runs = decode_runs([TraceRequest(0.0, 5000, 3), TraceRequest(0.0, 10, 20)])
    assert list(runs) == [(1, 2), (2, 2), (1, 15)]


def test_bad_simulation_arguments_are_rejected_before_running():
    with pytest.raises(ValueError, match="max_running"):
        decode_runs([TraceRequest(0.0, 10, 2)], max_running=0)


def test_max_running_queues_requests_until_a_slot_frees():
    requests = [TraceRequest(0.0, 10, 3) for _ in range(3)]
    assert simulate(requests, max_running=2) == {2: 2, 1: 2}


def test_arrivals_wait_for_the_next_step_boundary():
    # Arrives 10 ms in: admitted at the 30 ms step boundary; 1 s later the second one.
    histogram = simulate([TraceRequest(0.01, 10, 2), TraceRequest(1.0, 10, 2)])
    assert histogram == {1: 2}


def test_rate_scale_compresses_arrivals_into_bigger_batches():
    requests = [TraceRequest(i * 0.3, 10, 11) for i in range(10)]
    assert max(simulate(requests, rate_scale=10.0)) > max(simulate(requests))


@given(
    requests=st.lists(
        st.builds(
            TraceRequest,
            st.floats(0, 5),
            st.integers(1, 5000),
            st.integers(1, 40),
        ),
        min_size=1,
        max_size=30,
    ),
    max_running=st.integers(1, 8),
)
def test_decode_steps_equal_output_tokens_minus_the_prefilled_one(requests, max_running):
    histogram = simulate(requests, max_running=max_running)
    assert all(1 <= size <= max_running for size in histogram)
    decoded = sum(size * steps for size, steps in histogram.items())
    assert decoded == sum(r.output_tokens - 1 for r in requests)


def test_halves_restart_the_clock():
    requests = [TraceRequest(float(i), 10, 2) for i in range(5)]
    first, second = halves(requests)
    assert [r.arrival_s for r in first] == [0.0, 1.0]
    assert [r.arrival_s for r in second] == [0.0, 1.0, 2.0]


def test_azure_csv_is_read_relative_to_the_first_arrival(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47.5000000,10,3\n"
        "2023-11-16 18:15:46.2500000,374,44\n"
    )
    requests = read_azure_trace(path)
    assert requests == [TraceRequest(0.0, 374, 44), TraceRequest(pytest.approx(1.25), 10, 3)]


def test_azure_csv_with_a_bad_row_names_the_line(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,ten,3\n")
    with pytest.raises(ValueError, match=r"trace\.csv:2"):
        read_azure_trace(path)


@pytest.mark.skipif(not AZURE.is_dir(), reason="the Azure trace is not checked out beside the repo")
def test_real_code_trace_gives_small_decode_batches():
    histogram = simulate(read_azure_trace(AZURE / "AzureLLMInferenceTrace_code.csv"))
    mean = sum(size * steps for size, steps in histogram.items()) / sum(histogram.values())
    assert 1 <= mean < 32
    assert max(histogram) <= 256
