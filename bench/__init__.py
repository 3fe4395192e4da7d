"""Benchmark suite for ortspec: ``suite`` (the run, ``python -m bench.suite``), ``engines`` (the engines under
test), ``report`` (summaries and result files), ``limits`` (physical limits of a decode step), ``workloads``,
``peers`` (peer-engine runners), ``machine`` (machine facts) and ``replay``.

Run from the repository root as a plain top-level package, e.g.
``python -m bench.workloads`` or ``python -m bench.machine``.
"""
