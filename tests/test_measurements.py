"""The Engine's measurements (verify drift, verify cost curve): made once, kept in one cache file per model file,
provider, thread count and onnxruntime version, with probes that fit any capacity, measured only after the
user's input was checked, and never in the way of an error about that input."""

from __future__ import annotations

import json

import pytest

from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.measurements import (
    cached_measurement,
    cached_pass_costs,
    cached_verify_drift,
    drift_probe,
    pass_cost_probe,
)
from ortspec.backends.base import BackendError
from ortspec.backends.fake import FakeBackend, FakeModel
from ortspec.backends.onnx import BackendConfig


class CountingSession:
    def __init__(self, inner):
        self.inner, self.runs = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_with_iobinding(self, *args):
        self.runs += 1
        return self.inner.run_with_iobinding(*args)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_drift_and_costs_are_measured_once_and_read_from_one_file(tiny_model_dir, cache):
    first = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    first.generate("abc abc abc", max_tokens=4, speculative="prompt-lookup")  # measures both
    files = list((cache / "measurements").glob("*.json"))
    assert files == [first.measurements.measurement_file()]
    records = json.loads(files[0].read_text())
    assert set(records) == {"verify_drift", "pass_costs", "batch decode costs"}
    assert records["pass_costs"]["params"]["kmax"] == 16 and len(records["pass_costs"]["result"]["curve"]) == 17

    second = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))  # a new process would see the same: a new Engine
    counter = CountingSession(second.batch.session)
    second.batch.session = counter
    result = second.generate("abc abc abc", max_tokens=4, speculative="prompt-lookup")
    assert counter.runs == result.stats.steps  # only the generation's own passes: nothing was measured
    m1, m2 = first.measurements, second.measurements
    assert m2.verify_drift() == m1.verify_drift() and m2.pass_costs() == m1.pass_costs()

    other_threads = Engine.from_dir(tiny_model_dir, BackendConfig(threads=2))
    assert other_threads.measurements.measurement_file() != m1.measurement_file()


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 9, 17, 18, 40])
def test_probes_fit_any_capacity(capacity):
    backend = FakeBackend(FakeModel(vocab_size=50), max_length=capacity)
    context, k = pass_cost_probe(capacity, 16)
    assert context >= 1 and (k == 0 or context + 1 + k <= capacity)
    curve = cached_pass_costs(backend, None, 16, repeats=1)
    assert len(curve) == 17 and curve[0] == 1.0 and all(b >= a for a, b in zip(curve, curve[1:], strict=False))
    probe = drift_probe(capacity)
    assert (probe is None) == (capacity < 3)
    if probe is not None:
        assert probe[0] + probe[1] <= capacity and probe[1] >= 2
    assert cached_verify_drift(backend, None) == 0.0  # the fake backend's verify rows are exact
    assert backend.peak_len <= capacity


def test_a_small_max_length_measures_and_generates(tiny_model_dir, cache):
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1, max_length=5))
    result = engine.generate([5, 6], max_tokens=8, speculative="prompt-lookup")
    assert len(result.token_ids) == 3 and result.finish_reason == "context_full"
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens but the context holds 5 \(max_length"):
        engine.generate("a prompt longer than five tokens, surely", max_tokens=4, speculative="prompt-lookup")


def test_input_errors_come_before_any_measurement(tiny_model_dir, cache):
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1, max_length=8))
    counter = CountingSession(engine.batch.session)
    engine.batch.session = counter
    for call in (
        lambda: engine.generate("far too long a prompt for eight tokens", speculative="prompt-lookup"),
        lambda: engine.generate([1, 999], speculative="prompt-lookup"),
        lambda: engine.generate("x", stop=[""], speculative="prompt-lookup"),
    ):
        with pytest.raises(ValueError):
            call()
    assert counter.runs == 0 and not (cache / "measurements").exists()


def test_a_failing_measurement_says_what_was_measured(tiny_model_dir, cache):
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))

    class Broken:
        def run_with_iobinding(self, *args):
            raise RuntimeError("device lost")

    real = engine.batch.session
    engine.batch.session = Broken()
    with pytest.raises(BackendError, match="measuring this model's verify drift failed"):
        engine.generate("abc", max_tokens=3, speculative="prompt-lookup")
    engine.batch.session = real
    assert len(engine.generate("abc", max_tokens=3, ignore_eos=True, speculative="prompt-lookup").token_ids) == 3


def test_cached_measurement_rereads_remeasures_and_survives_bad_files(tmp_path):
    file = tmp_path / "m.json"
    calls = []

    def measure():
        calls.append(1)
        return {"value": len(calls)}

    assert cached_measurement(file, "x", {"a": 1}, measure) == {"value": 1}
    assert cached_measurement(file, "x", {"a": 1}, measure) == {"value": 1}  # read back
    assert cached_measurement(file, "x", {"a": 2}, measure) == {"value": 2}  # other params: measured again
    assert cached_measurement(file, "y", {"a": 2}, measure) == {"value": 3}  # another measurement, same file
    assert set(json.loads(file.read_text())) == {"x", "y"}
    file.write_text("{half a file")
    assert cached_measurement(file, "x", {"a": 2}, measure) == {"value": 4}
    assert cached_measurement(None, "x", {"a": 2}, measure) == {"value": 5}  # no file: always measured
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temporary files left behind


def test_batch_decode_costs_are_measured_once_and_kept(cache, tiny_model_dir):
    """The batch backend's decode cost curve: 0 for no rows, 1 for one, non-decreasing to the slots; a second
    Engine on the same folder reads it from the cache without running a pass."""
    from ortspec.adapters.engine.engine import DEFAULT_SLOTS
    from ortspec.adapters.engine.measurements import batch_sizes

    assert batch_sizes(16) == (1, 2, 4, 8, 16) and batch_sizes(6) == (1, 2, 4, 6) and batch_sizes(1) == (1,)
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    costs = engine.measurements.batch_decode_costs()
    assert len(costs) == DEFAULT_SLOTS + 1 and costs[:2] == (0.0, 1.0)
    assert all(b >= a for a, b in zip(costs, costs[1:], strict=False))
    assert engine.batch.runs > 0
    assert all(engine.batch.current_len(slot) == 0 for slot in range(DEFAULT_SLOTS))
    again = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    assert again.measurements.batch_decode_costs() == costs and again.batch.runs == 0
    # the scheduler prices plain steps with it once a request's width is priced ("auto"); plain requests leave it
    plain = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    plain.generate("abc", max_tokens=3, speculative=None)
    assert plain.scheduler.decode_costs is None
    again.generate("abc", max_tokens=3, speculative="prompt-lookup")
    assert again.scheduler.decode_costs == costs
