"""The transformers adapter's tests run only where a supported transformers is installed."""

import pytest

pytest.importorskip("transformers")

from pytest_graphmode.hf.engine import UnsupportedTransformers, check_version  # noqa: E402

try:
    check_version()
except UnsupportedTransformers as exc:
    pytest.skip(str(exc), allow_module_level=True)
