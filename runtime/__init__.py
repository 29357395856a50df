"""The graph runtime: backends, buckets, buffers, executor, memory pools and the reference decoder."""
