"""The benchmarks: thin command-line scripts over ``benchmarks.lib``, run as modules from the
repository root (``python -m benchmarks.throughput --workload tiny``); docs/benchmarks.md has the
commands and the figures."""
