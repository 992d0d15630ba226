"""Benchmarks: `python -m bench.engine` (in-process engine vs HF generate, ratios measured side by side)."""
