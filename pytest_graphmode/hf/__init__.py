"""transformers' continuous-batching runner as a shipped target (the `hf` extra).

`pytest_graphmode.hf.target:make_target` is the factory to name with `--graphmode-target`.
Everything that depends on transformers' private surface is in `engine` (what every supported
release shares) and in one module per layout of its paged cache (`paged_tensors` for 5.4 to 5.17,
`sector_cache` for 5.18 to 5.24), and in `continuous_api` for 5.0 to 5.3, whose batch processor is
built inside the generation loop; `versions` admits the releases and says which layout each has.
Importing this package needs no transformers; making a target does.
"""
