"""`python -m pytest_graphmode.runtime.buckets plan|replay|simulate ...`."""

import sys

from pytest_graphmode.runtime.buckets._cli import main

sys.exit(main())
