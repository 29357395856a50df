"""Shared set-up of the plugin tests.

pytester's in-process runs drop the modules they imported afterwards; torch and the sim backend
(which installs a process-wide dispatch mode) cannot be imported twice, so they are imported once
here, before any run. So is `torch._dynamo`: torch imports it on the first call of a dispatch
mode, and it registers an operator library that a second import would register again (then every
later campaign in the process fails with "Only a single TORCH_LIBRARY can be used").
"""

from pathlib import Path

import pytest
import torch._dynamo

from pytest_graphmode import fuzz
from pytest_graphmode.runtime.backends import sim

PRELOADED = (fuzz, sim, torch._dynamo)
TOY_SOURCE = Path(__file__).with_name("toy_target.py").read_text()
TOY = "graphmode_toy:make_target"
BROKEN_TOY = "graphmode_toy:make_broken_target"


@pytest.fixture
def toy_project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project with the toy target importable as `graphmode_toy` and no tests of its own."""
    pytester.makepyfile(graphmode_toy=TOY_SOURCE)
    pytester.syspathinsert()
    return pytester
