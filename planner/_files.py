"""The planner's file formats: histogram CSV, latency CSV, schedule lists and batch-size traces.

- histogram CSV: header `batch_size,count`, then one row per batch size.
- latency CSV: header `size,latency`, then one row per capture size (any unit, used as T).
- schedule file: capture sizes separated by commas, spaces or newlines.
- trace: one batch size per line, or a JSON object whose `batch_sizes` is a list of ints.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path

HISTOGRAM_HEADER = ("batch_size", "count")
LATENCY_HEADER = ("size", "latency")


def _read_table(path: Path, header: tuple[str, str]) -> list[tuple[int, str, str]]:
    with path.open(newline="") as handle:
        rows = [(n, row) for n, row in enumerate(csv.reader(handle), start=1) if row]
    if not rows or tuple(cell.strip() for cell in rows[0][1]) != header:
        raise ValueError(f"{path}: the first line must be the header {','.join(header)}")
    table = []
    for line, row in rows[1:]:
        if len(row) != 2:
            raise ValueError(f"{path}:{line}: expected 2 columns ({','.join(header)}), got {row}")
        table.append((line, row[0].strip(), row[1].strip()))
    if not table:
        raise ValueError(f"{path}: no rows after the header")
    return table


def _int(path: Path, line: int, text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{path}:{line}: {what} must be an int, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{path}:{line}: {what} must be >= 1, got {value}")
    return value


def _float(path: Path, line: int, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{path}:{line}: {what} must be a number, got {text!r}") from None
    if not value >= 0:
        raise ValueError(f"{path}:{line}: {what} must be >= 0, got {text!r}")
    return value


def _unique(path: Path, rows: list[tuple[int, int, float]], what: str) -> dict[int, float]:
    result: dict[int, float] = {}
    for line, key, value in rows:
        if key in result:
            raise ValueError(f"{path}:{line}: {what} {key} appears twice")
        result[key] = value
    return result


def read_histogram(path: str | Path) -> dict[int, float]:
    path = Path(path)
    rows = [
        (line, _int(path, line, size, "batch_size"), _float(path, line, count, "count"))
        for line, size, count in _read_table(path, HISTOGRAM_HEADER)
    ]
    return _unique(path, rows, "batch_size")


def write_histogram(path: str | Path, histogram: Mapping[int, float]) -> None:
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HISTOGRAM_HEADER)
        for size in sorted(histogram):
            count = histogram[size]
            writer.writerow((size, int(count) if float(count).is_integer() else count))


def read_latency(path: str | Path) -> dict[int, float]:
    path = Path(path)
    rows = [
        (line, _int(path, line, size, "size"), _float(path, line, latency, "latency"))
        for line, size, latency in _read_table(path, LATENCY_HEADER)
    ]
    return _unique(path, rows, "size")


def read_sizes(path: str | Path) -> list[int]:
    path = Path(path)
    sizes = [
        _int(path, line, token, "capture size")
        for line, raw in enumerate(path.read_text().splitlines(), start=1)
        for token in raw.replace(",", " ").split()
    ]
    if not sizes:
        raise ValueError(f"{path}: no capture sizes (write them separated by commas or spaces)")
    return sizes


def read_trace(path: str | Path) -> list[int]:
    """Batch sizes in step order from a one-per-line file or a JSON step log."""
    path = Path(path)
    text = path.read_text()
    if text.lstrip().startswith("{"):
        log = json.loads(text)
        sizes = log.get("batch_sizes")
        if not isinstance(sizes, list):
            raise ValueError(f"{path}: a JSON trace needs a 'batch_sizes' list")
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{path}: batch_sizes must hold positive ints, got {size!r}")
        return sizes
    trace = [
        _int(path, line, stripped, "batch size")
        for line, raw in enumerate(text.splitlines(), start=1)
        if (stripped := raw.strip())
    ]
    if not trace:
        raise ValueError(f"{path}: the trace has no batch sizes")
    return trace
