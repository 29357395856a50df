"""File formats: histogram and latency CSV, schedule lists, batch-size traces."""

import json

import pytest

from pytest_graphmode.planner import (
    read_histogram,
    read_latency,
    read_sizes,
    read_trace,
    write_histogram,
)


def test_histogram_round_trips(tmp_path):
    path = tmp_path / "h.csv"
    write_histogram(path, {7: 3, 1: 10})
    assert path.read_text().splitlines() == ["batch_size,count", "1,10", "7,3"]
    assert read_histogram(path) == {1: 10.0, 7: 3.0}


def test_histogram_without_header_is_rejected(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("1,10\n")
    with pytest.raises(ValueError, match="header batch_size,count"):
        read_histogram(path)


def test_histogram_errors_name_the_line(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("batch_size,count\n1,10\nx,3\n")
    with pytest.raises(ValueError, match=r"h\.csv:3: batch_size must be an int"):
        read_histogram(path)


def test_duplicate_histogram_rows_are_rejected(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("batch_size,count\n4,1\n4,2\n")
    with pytest.raises(ValueError, match="appears twice"):
        read_histogram(path)


def test_latency_table_reads_sizes_and_floats(tmp_path):
    path = tmp_path / "lat.csv"
    path.write_text("size,latency\n8,1.5\n16,2.25\n")
    assert read_latency(path) == {8: 1.5, 16: 2.25}


def test_negative_latency_is_rejected(tmp_path):
    path = tmp_path / "lat.csv"
    path.write_text("size,latency\n8,-1\n")
    with pytest.raises(ValueError, match="latency must be >= 0"):
        read_latency(path)


def test_schedule_file_accepts_commas_spaces_and_lines(tmp_path):
    path = tmp_path / "sizes.txt"
    path.write_text("1, 2 4\n8\n")
    assert read_sizes(path) == [1, 2, 4, 8]


def test_trace_reads_one_size_per_line(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("3\n\n5\n1\n")
    assert read_trace(path) == [3, 5, 1]


def test_trace_reads_a_json_step_log(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"batch_sizes": [2, 9], "backend": "sim"}))
    assert read_trace(path) == [2, 9]


def test_json_trace_without_batch_sizes_is_rejected(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"steps": [2]}))
    with pytest.raises(ValueError, match="'batch_sizes' list"):
        read_trace(path)
