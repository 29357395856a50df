"""transformers' continuous-batching runner as a shipped target (the `hf` extra).

`pytest_graphmode.hf.target:make_target` is the factory to name with `--graphmode-target`;
`pytest_graphmode.hf.engine` holds everything that depends on transformers' private surface.
Importing this package needs no transformers; making a target does.
"""
