"""docs/planner.md's worked example runs from a clone: its commands, on the data in the repository,
print the numbers the document shows; and the command line stays quiet when its reader leaves."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_graphmode.planner._cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/planner.md"
DATA = "planner/data/azure-2023"


def documented_commands() -> list[list[str]]:
    """The first code block of the worked example, `$D` and `$B` expanded, one argv per command."""
    text = DOC.read_text().split("## Worked example", 1)[1]
    block = text.split("```", 2)[1]
    joined = block.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line)
        if words and words[0] == "$B":
            commands.append([w.replace("$D", DATA) for w in words[1:]])
    return commands


def test_the_worked_example_reads_only_data_in_the_repository() -> None:
    commands = documented_commands()
    assert len(commands) == 6
    files = [w for argv in commands for w in argv if w.startswith(DATA)]
    assert files and all((ROOT / f).is_file() for f in files), files


def test_the_worked_example_prints_the_documented_plans(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)
    out = []
    for argv in documented_commands():
        argv = [w.replace("/tmp/planner", str(tmp_path)) for w in argv]
        assert main(argv) == 0, argv
        out.append(capsys.readouterr().out)
    text = DOC.read_text()
    assert "sizes: 13, 29, 33, 37, 41, 46, 52, 62" in out[0]
    assert "`13, 29, 33, 37, 41, 46, 52, 62`" in text
    assert "sizes: 1, 3, 5, 8, 11, 16, 27, 53" in out[1]
    assert "sizes: 1, 2, 4, 8, 28, 33, 37, 41, 46, 52, 62" in out[2]
    assert re.search(r"replay: 59021 steps on 51 graphs .*\n.*padding ratio 9\.63%", out[3])
    assert re.search(r"replay: 59021 steps on 11 graphs .*\n.*padding ratio 6\.98%", out[4])


def test_align_help_says_the_top_size_is_always_planned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "sizes below the top size must be multiples of M (the top size is always planned)" in (
        help_text
    )


def test_a_reader_that_stops_early_is_not_an_error(tmp_path: Path) -> None:
    # The reader is gone before the first line is written, as `| head -0` would be.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest_graphmode.planner",
            "replay",
            "--trace",
            f"{DATA}/conv-second-steps.txt",
            "--schedule",
            "vllm",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    error = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, error
    assert error == ""
