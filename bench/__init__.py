"""The benchmarks and the bench checks of the gateway, run from the checkout as ``python -m bench``.

- ``__main__``: the one entry point: every workload (``python -m bench [--smoke] [--only ...]``), one
  workload alone with its own options (``python -m bench fanout ...``), the checks (``python -m bench
  checks``);
- ``suite``: every workload in one run, beside its floors, into docs/benchmarks.md;
- ``checks/``: the bounds of time and size the project promises (leases and expiry within 1 s under load,
  the database within 1.2x under churn, ...), each figure beside its target;
- ``workloads/``: the measurements, one module a workload (or a family of them);
- ``programs/``: what the bench starts as processes of their own (the client processes, the floor
  servers, the gateway run through a probe);
- ``lib/``: what they share: processes and databases that die with the run (``harness``), the report and
  docs/benchmarks.md (``report``), what a run needs (``needs``), what a check reports (``verdict``).

A layer imports only the layers below it (pyproject.toml's import-linter contracts); the gateway imports
nothing of the bench.
"""
