"""`python -m pytest_graphmode.planner plan|replay|simulate ...`."""

import sys

from pytest_graphmode.planner._cli import main

sys.exit(main())
