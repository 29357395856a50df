"""The conformance suite: one CUDA-graph semantic per case, run on every available backend."""
