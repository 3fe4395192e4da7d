"""Benchmark suite for ortspec: workloads, peer-engine runners, machine facts.

Run from the repository root as a plain top-level package, e.g.
``python -m bench.workloads`` or ``python -m bench.machine``.
"""
