"""`detection.py --checkout` measures a checkout only where its interpreter imports that checkout.

A plain source tree (a `git archive` of an earlier commit, say) put first on the path of an
interpreter that has this repository installed in editable mode gives that tree's
`pytest_graphmode` but this repository's `strategies/` and `runtime/`: a comparison of two
checkouts would then draw the same schedules on both. The check refuses such a checkout.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.mutants.detection import (
    MAPPED_SUBPACKAGES,
    REPOSITORY,
    Checkout,
    check_imports_its_own_code,
)

IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def test_this_repository_imports_its_own_code() -> None:
    check_imports_its_own_code(Checkout("this", sys.executable, REPOSITORY))


def test_a_source_tree_without_its_sub_packages_in_place_is_refused(tmp_path: Path) -> None:
    shutil.copytree(REPOSITORY / "pytest_graphmode", tmp_path / "pytest_graphmode", ignore=IGNORE)
    with pytest.raises(SystemExit, match="checkout old") as refused:
        check_imports_its_own_code(Checkout("old", sys.executable, tmp_path))
    # Either the installed repository's sub-packages were found instead, or none at all.
    assert "imports code from elsewhere" in str(refused.value) or "cannot import" in str(
        refused.value
    )


def test_a_source_tree_with_its_sub_packages_copied_in_is_measured(tmp_path: Path) -> None:
    package = tmp_path / "pytest_graphmode"
    shutil.copytree(REPOSITORY / "pytest_graphmode", package, ignore=IGNORE)
    for name in MAPPED_SUBPACKAGES:
        shutil.copytree(REPOSITORY / name, package / name, ignore=IGNORE)
    check_imports_its_own_code(Checkout("old", sys.executable, tmp_path))
