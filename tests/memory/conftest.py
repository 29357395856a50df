import os

import pytest

from pytest_graphmode.runtime.memory import HostPool

GRANULARITY = 64 << 10  # small chunks keep the tests cheap; the pool's default is 2 MiB
VIEW_CAPACITY = 1 << 20


@pytest.fixture
def pool():
    with HostPool(GRANULARITY, VIEW_CAPACITY) as pool:
        yield pool


def mapping_count() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))
