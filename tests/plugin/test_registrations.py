"""Everything the plugin adds to a run carries its `graphmode` prefix, so it never changes the
meaning of a project's own markers and fixtures."""

from __future__ import annotations

import re

import pytest

OWN_CUDA_MARKER = """
import pytest

def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: this project's own meaning")
"""


def _markers(pytester: pytest.Pytester, *args: str) -> set[str]:
    result = pytester.runpytest("--markers", *args)
    return {
        m.group(1) for line in result.outlines if (m := re.match(r"@pytest\.mark\.(\w+)", line))
    }


def _fixtures(pytester: pytest.Pytester, *args: str) -> set[str]:
    result = pytester.runpytest("--fixtures", *args)
    return {m.group(1) for line in result.outlines if (m := re.match(r"(\w+)( \[.*\])? -- ", line))}


def test_every_marker_and_fixture_of_the_plugin_is_prefixed(pytester: pytest.Pytester) -> None:
    markers = _markers(pytester) - _markers(pytester, "-p", "no:graphmode")
    fixtures = _fixtures(pytester) - _fixtures(pytester, "-p", "no:graphmode")
    assert markers == {"graphmode_fuzz", "graphmode_cuda"}
    assert fixtures, "no fixture of the plugin was listed"
    assert all(name.startswith("graphmode_") for name in fixtures), sorted(fixtures)


def test_a_projects_own_cuda_marker_keeps_its_meaning(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(OWN_CUDA_MARKER)
    pytester.makepyfile("import pytest\n@pytest.mark.cuda\ndef test_mine():\n    pass\n")
    pytester.runpytest("--strict-markers").assert_outcomes(passed=1)
