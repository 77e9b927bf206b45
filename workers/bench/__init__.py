"""Benchmark drivers behind `das bench ...`: each prints one JSON object a script can compare."""
