"""A class attribute replaced for a block and put back exactly, as the harness's cuda hooks need."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def replacing(
    owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """`owner.name` replaced for the block by `wrap(original)`; on exit, also when the block
    raises, the exact attribute `owner` had is put back (or removed, where it inherited it)."""
    owned = name in vars(owner)
    before = vars(owner).get(name)
    original = getattr(owner, name)  # what an instance resolves today, inherited or not
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        if owned:
            setattr(owner, name, before)
        else:
            delattr(owner, name)
