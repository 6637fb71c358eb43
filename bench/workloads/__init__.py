"""The workloads: each measures the gateway beside a floor (see docs/benchmarks.md's list)."""
