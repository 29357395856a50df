"""Counter-based sampling: greedy rows, independence from the batch, and the right distribution."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime.model import sample

VOCAB = 32
seeds = st.integers(0, 2**62)
positions = st.integers(0, 2**40)
temperatures = st.floats(0.125, 4.0, width=32)


def _logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draw(logits: torch.Tensor, seed: list[int], temp: list[float], pos: list[int]) -> torch.Tensor:
    return sample(
        logits,
        torch.tensor(seed, dtype=torch.int64),
        torch.tensor(temp, dtype=torch.float32),
        torch.tensor(pos, dtype=torch.int64),
    )


@given(logits_seed=st.integers(0, 2**16), rows=st.integers(1, 8), position=positions)
def test_negative_seed_rows_are_argmax(logits_seed: int, rows: int, position: int) -> None:
    logits = _logits(logits_seed, rows)
    tokens = _draw(logits, [-1] * rows, [1.0] * rows, [position] * rows)
    assert torch.equal(tokens, logits.argmax(dim=-1))


@given(logits_seed=st.integers(0, 2**16), seed=seeds, position=positions)
def test_zero_temperature_rows_are_argmax(logits_seed: int, seed: int, position: int) -> None:
    logits = _logits(logits_seed, 1)
    assert torch.equal(_draw(logits, [seed], [0.0], [position]), logits.argmax(dim=-1))


@given(
    logits_seed=st.integers(0, 2**16),
    seed=seeds,
    position=positions,
    temperature=temperatures,
    company=st.lists(st.tuples(seeds, positions, temperatures), max_size=6),
    data=st.data(),
)
def test_a_rows_sample_ignores_batch_company_and_row_order(
    logits_seed: int,
    seed: int,
    position: int,
    temperature: float,
    company: list[tuple[int, int, float]],
    data: st.DataObject,
) -> None:
    alone = _draw(_logits(logits_seed, 1), [seed], [temperature], [position])
    rows = [(seed, position, temperature), *company]
    order = data.draw(st.permutations(range(len(rows))))
    batch_logits = _logits(logits_seed + 1, len(rows))
    batch_logits[0] = _logits(logits_seed, 1)[0]
    shuffled = _draw(
        batch_logits[list(order)],
        [rows[i][0] for i in order],
        [rows[i][2] for i in order],
        [rows[i][1] for i in order],
    )
    assert shuffled[order.index(0)] == alone[0]


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=4).double() / tokens.numel()


LOGITS_ROW = torch.tensor([1.0, 0.0, -0.5, 2.0])
DRAWS = 20_000
# Four standard errors of a frequency estimated from DRAWS samples, at worst p = 1/2.
TOLERANCE = 4 * 0.5 / DRAWS**0.5


def test_frequencies_over_seeds_follow_the_tempered_softmax() -> None:
    logits = LOGITS_ROW.expand(DRAWS, 4)
    tokens = _draw(logits, list(range(DRAWS)), [0.7] * DRAWS, [5] * DRAWS)
    expected = torch.softmax(LOGITS_ROW.double() / 0.7, dim=0)
    torch.testing.assert_close(_frequencies(tokens), expected, atol=TOLERANCE, rtol=0)


def test_frequencies_over_positions_follow_the_softmax() -> None:
    logits = LOGITS_ROW.expand(DRAWS, 4)
    tokens = _draw(logits, [12345] * DRAWS, [1.0] * DRAWS, list(range(DRAWS)))
    expected = torch.softmax(LOGITS_ROW.double(), dim=0)
    torch.testing.assert_close(_frequencies(tokens), expected, atol=TOLERANCE, rtol=0)


def test_large_seeds_differing_only_in_high_bits_draw_different_noise() -> None:
    logits = LOGITS_ROW.expand(DRAWS, 4)
    tokens = _draw(logits, [(i << 33) + 7 for i in range(DRAWS)], [1.0] * DRAWS, [3] * DRAWS)
    expected = torch.softmax(LOGITS_ROW.double(), dim=0)
    torch.testing.assert_close(_frequencies(tokens), expected, atol=TOLERANCE, rtol=0)
