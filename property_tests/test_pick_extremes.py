"""Every pick returns: for any options ``Sampling`` accepts (extreme temperatures, penalties, ``top_k`` past the
vocabulary, tiny ``top_p``) and any row (huge, tied, partly ``-inf``, saturated), ``StepContext.pick`` gives a token
of the row with a logprob that is not NaN, or refuses the row with ``NonFiniteRow``; nothing else is raised and
nothing loops. A server's batch thread makes every pick, so a pick that never returns freezes every request behind
it: the fuzzing of ``/v1/completions`` found one (a temperature past float32 with ``top_k`` past the window), fixed
in ``core/sampling.py``'s ``_top_k``. Each pick runs on a worker thread joined with a bound, so a loop fails the test
instead of hanging the suite.
"""

from __future__ import annotations

import math
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ortspec.core.checks import ArgumentError
from ortspec.core.sampling import NonFiniteRow, Pick, Sampling, StepContext
from property_tests.conftest import examples

# values at and past float32's edges (smallest normal, largest finite), and float64's
EDGES = [0.0, 1e-38, 1.2e-38, 1e-30, 1e-3, 0.7, 1.0, 3.4e38, 3.5e38, 1e300, 1.7e308]
OPTION_VALUES = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGES))
PROMPT, GENERATED, DRAFTED = (1, 2, 3), (0, 5, 5), (4,)  # every id below the least vocabulary drawn (8)
BOUND_S = 20.0  # a pick takes milliseconds; only a loop reaches this


@st.composite
def rows(draw) -> np.ndarray:
    n = draw(st.integers(8, 600))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "extreme", "tied", "partly -inf"]))
    if kind == "normal":
        row = rng.normal(0.0, draw(st.sampled_from([0.01, 1.0, 10.0, 1e3, 1e30])), n)
    elif kind == "extreme":
        row = rng.choice([-3.4e38, 3.4e38, 0.0, -np.inf, 1.0], n)
    elif kind == "tied":
        row = np.full(n, draw(st.sampled_from([0.0, 1e30, -1e30, 3.4e38])))
    else:
        row = rng.normal(0.0, 1.0, n)
        row[rng.integers(0, n, max(1, n // 3))] = -np.inf
    return row.astype(np.float32)


OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": OPTION_VALUES,
        "top_k": st.integers(0, 2000),
        "top_p": st.floats(1e-9, 1.0),
        "min_p": st.floats(0.0, 1.0),
        "repetition_penalty": OPTION_VALUES,
        "presence_penalty": OPTION_VALUES,
        "frequency_penalty": OPTION_VALUES,
    },
)


@settings(max_examples=examples(1200))
@given(rows(), OPTIONS, st.integers(0, 2**64 - 1), st.booleans(), st.integers(0, 5))
def test_every_pick_returns_a_token_or_refuses_the_row(row, options, seed, margin, top_n):
    try:
        sampling = Sampling(**options, seed=seed)
    except ArgumentError:
        return  # refused with a named field: the server's 400
    outcome: dict[str, object] = {}

    def pick() -> None:
        try:
            outcome["pick"] = StepContext(sampling, PROMPT, GENERATED).pick(row, 0, DRAFTED, margin=margin, top_n=top_n)
        except NonFiniteRow:
            outcome["pick"] = None
        except Exception as exc:  # noqa: BLE001 - any other exception is the failure reported below
            outcome["error"] = exc

    worker = threading.Thread(target=pick, daemon=True)
    worker.start()
    worker.join(BOUND_S)
    assert not worker.is_alive(), f"the pick did not return within {BOUND_S} s: {options}"
    assert "error" not in outcome, f"{outcome['error']!r} for {options}"
    got = outcome["pick"]
    if got is not None:
        assert isinstance(got, Pick)
        assert 0 <= got.token < len(row)
        assert not math.isnan(got.logprob)
