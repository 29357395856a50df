"""Hypothesis strategies for graph-mode fuzzing."""
