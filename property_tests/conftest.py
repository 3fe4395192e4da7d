"""Hypothesis profiles: ``ci`` (the default, >= 10,000 examples of the equivalence property in a few minutes)
and ``thorough`` (far more). Choose with HYPOTHESIS_PROFILE=thorough."""

import os

from hypothesis import HealthCheck, settings

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    derandomize=False,
    print_blob=True,
)
# `scale` multiplies each test's own example count (set with @settings in the tests).
settings.register_profile("ci", **_common)
settings.register_profile("thorough", **_common)
settings.register_profile("quick", **_common)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SCALE = {"ci": 1.0, "thorough": 20.0, "quick": 0.05}[PROFILE]
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """This profile's example count for a test written for ``n`` examples in the ci profile."""
    return max(10, int(n * SCALE))
