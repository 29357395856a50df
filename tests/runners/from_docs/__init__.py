"""Runners written from the public docs alone (docs/contract.md, docs/own-runner.md, the facade
and the example runners they name), without reading the harness: each a design of its own, with
one bug modelled on one that public serving engines shipped. `make_target` is the correct
runner, `make_buggy_target` the same runner with the few lines of the bug changed (each module's
docstring says which). Each is self-contained on purpose, sharing no code with the others, the
project's runtime or its other runners, as a runner written elsewhere would not, although all
follow the shape of `tests/runners/minimal.py` the docs teach. They show what the harness finds
in a runner it was not built around; `tests/runners/test_from_docs.py` holds what they must show, docs/mutants.md the figures."""
