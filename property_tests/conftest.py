"""Hypothesis profiles: ``ci`` (the default, 6,000 examples of the equivalence property, 3,000 per pick mode, within
the README test command's 15 minutes), ``full`` (2x), ``thorough`` (20x), ``quick`` (5%) and ``mutation`` (ci
counts, no shrinking; for scripts/mutation_check.py). Choose with HYPOTHESIS_PROFILE=full (or thorough).

After the run, the edge-coverage rates of the equivalence property (``property_tests/edges.py``) are printed,
and the session fails if one is below its target."""

import os

from hypothesis import HealthCheck, Phase, settings

from property_tests import edges

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    derandomize=False,
    print_blob=True,
)
# `scale` multiplies each test's own example count (set with @settings in the tests).
settings.register_profile("ci", **_common)
settings.register_profile("full", **_common)
settings.register_profile("thorough", **_common)
settings.register_profile("quick", **_common)
# scripts/mutation_check.py: the ci example counts without shrinking (only whether a test fails matters).
settings.register_profile("mutation", **_common, phases=[Phase.explicit, Phase.reuse, Phase.generate])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SCALE = {"ci": 1.0, "full": 2.0, "thorough": 20.0, "quick": 0.05, "mutation": 1.0}[PROFILE]
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """This profile's example count for a test written for ``n`` examples in the ci profile."""
    return max(10, int(n * SCALE))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines, missed = edges.report()
    for line in lines:
        terminalreporter.write_line(line)
    if missed:
        terminalreporter.write_line(f"edge coverage below target: {', '.join(missed)}", red=True)


def pytest_sessionfinish(session, exitstatus):
    _, missed = edges.report()
    if missed and session.exitstatus == 0:
        session.exitstatus = 1
