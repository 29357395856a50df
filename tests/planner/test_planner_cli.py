"""The command line, run through main() with argv; assertions are on the printed lines."""

import json

import pytest

from pytest_graphmode.planner._cli import main


@pytest.fixture
def histogram(tmp_path):
    path = tmp_path / "hist.csv"
    path.write_text("batch_size,count\n3,50\n7,30\n20,15\n30,5\n")
    return path


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_plan_prints_sizes_and_expected_padding(capsys, histogram):
    code, lines, _ = run(capsys, "plan", "--histogram", str(histogram), "--max-graphs", "3")
    assert code == 0
    assert lines[0].startswith("plan: 3 graphs for batch sizes up to 30")
    assert lines[1] == "sizes: 3, 7, 30"
    # Only batch 20 pads: 10 rows on 15% of the steps.
    assert "padded rows/step 1.500" in lines[2]


def test_plan_compares_every_engine_schedule_with_a_plan_of_at_most_as_many_graphs(
    capsys, histogram
):
    _, lines, _ = run(capsys, "plan", "--histogram", str(histogram))
    table = lines[lines.index(next(line for line in lines if line.startswith("schedule"))) + 1 :]
    names = [line.split()[0] for line in table]
    assert names == [
        "vllm",
        "plan",
        "sglang",
        "plan",
        "deepinfer",
        "plan",
        "nanovllm",
        "plan",
        "pow2",
        "plan",
    ]
    for fixed, planned in zip(table[::2], table[1::2], strict=True):
        assert int(planned.split()[1]) <= int(fixed.split()[1])  # at most as many graphs
        assert float(planned.split()[3]) <= float(fixed.split()[3])  # padded rows per step


def test_plan_judged_on_another_histogram_shows_eager_steps(capsys, histogram, tmp_path):
    judge = tmp_path / "judge.csv"
    judge.write_text("batch_size,count\n3,1\n40,1\n")
    _, lines, _ = run(capsys, "plan", "--histogram", str(histogram), "--judge", str(judge))
    assert any(line.startswith("engine schedules") and "judged on" in line for line in lines)
    plan_row = next(line for line in lines if line.startswith("plan "))
    assert plan_row.split()[-1] == "50.00%"


def test_plan_with_latency_table_only_uses_measured_sizes(capsys, histogram, tmp_path):
    latency = tmp_path / "lat.csv"
    latency.write_text("size,latency\n4,1.0\n16,1.1\n32,2.0\n30,1.9\n")
    _, lines, _ = run(
        capsys,
        "plan",
        "--histogram",
        str(histogram),
        "--latency",
        str(latency),
        "--max-graphs",
        "2",
    )
    assert lines[1] == "sizes: 16, 30"
    assert any(
        line.startswith("vllm") and "not compared: no latency for sizes [1, 2, 8," in line
        for line in lines
    )


def test_plan_with_alignment_and_include(capsys, histogram):
    _, lines, _ = run(
        capsys,
        "plan",
        "--histogram",
        str(histogram),
        "--align",
        "4",
        "--include",
        "8",
        "--max-graphs",
        "3",
    )
    assert lines[1] == "sizes: 4, 8, 30"


def test_plan_error_is_reported_with_exit_code_2(capsys, histogram):
    code, _, err = run(capsys, "plan", "--histogram", str(histogram), "--include", "64")
    assert code == 2
    assert err.startswith("error: included sizes [64] must not exceed the top size 30")


def test_replay_on_a_named_schedule(capsys, tmp_path):
    trace = tmp_path / "steps.json"
    trace.write_text(json.dumps({"batch_sizes": [3, 4, 5, 600]}))
    code, lines, _ = run(capsys, "replay", "--trace", str(trace), "--schedule", "vllm")
    assert code == 0
    assert lines[0] == "replay: 4 steps on 51 graphs (vllm, max 512)"
    assert lines[1] == (
        "graph steps 3, eager fallbacks 1 (25.00%),"
        " padding ratio 25.00% (4 padded rows / 16 executed)"
    )
    assert lines[3:5] == ["     4         2   50.00%", "     8         1   25.00%"]


def test_replay_on_a_schedule_file(capsys, tmp_path):
    trace = tmp_path / "steps.txt"
    trace.write_text("1\n2\n2\n")
    sizes = tmp_path / "sizes.txt"
    sizes.write_text("2,4")
    _, lines, _ = run(capsys, "replay", "--trace", str(trace), "--schedule", str(sizes))
    assert lines[-1] == "never hit (1): 4"


def test_replay_on_an_unknown_schedule_names_the_kinds(capsys, tmp_path):
    trace = tmp_path / "steps.txt"
    trace.write_text("1\n")
    code, _, err = run(capsys, "replay", "--trace", str(trace), "--schedule", "vlm")
    assert code == 2
    assert "'vlm' is neither a kind (vllm, sglang" in err


def test_simulate_writes_a_histogram(capsys, tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,100,4\n"
        "2023-11-16 18:15:46.0100000,100,4\n"
    )
    out = tmp_path / "hist.csv"
    code, lines, _ = run(capsys, "simulate", "--trace", str(trace), "--out", str(out))
    assert code == 0
    # The second request arrives 10 ms in and starts one 30 ms step later: they overlap 2 steps.
    assert lines == [f"simulated 2 requests (all): 4 decode steps, mean batch 1.5, max 2 -> {out}"]
    assert out.read_text().splitlines() == ["batch_size,count", "1,2", "2,2"]


def test_simulated_steps_replay_on_a_planned_schedule(capsys, tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,100,4\n"
        "2023-11-16 18:15:46.0100000,100,4\n"
        "2023-11-16 18:15:46.0200000,100,9\n"
    )
    hist, steps, sizes = tmp_path / "hist.csv", tmp_path / "steps.txt", tmp_path / "sizes.txt"
    run(capsys, "simulate", "--trace", str(trace), "--out", str(hist), "--steps-out", str(steps))
    assert steps.read_text().split() == ["1", "3", "3", "2", "1", "1", "1", "1", "1"]
    run(capsys, "plan", "--histogram", str(hist), "--max-graphs", "2", "--sizes-out", str(sizes))
    assert sizes.read_text() == "1,3\n"
    _, lines, _ = run(capsys, "replay", "--trace", str(steps), "--schedule", str(sizes))
    assert lines[1].endswith("padding ratio 6.67% (1 padded rows / 15 executed)")
