"""The built-in fuzz suite `pytest --graphmode-fuzz` runs where a project has no fuzz tests."""
