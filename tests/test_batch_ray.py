"""``ortspec batch --ray`` on a local Ray instance: the same output lines as the embedded runner (greedy, seeded
sampling, bad records; each actor one batched Engine), resumption from a killed run's OUTPUT, the model shipped
through the object store; and the same on SmolLM2 (``real_model``). Skipped without the ray extra
(``pip install 'ortspec[ray]'``)."""

from __future__ import annotations

import pytest
from test_batch import BAD_LINES, DEFAULTS, RECORDS, read_output, same_record, write_jsonl

from ortspec.adapters.batch import BatchJob, run_batch

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One local Ray instance (2 CPUs) for the module. Its workers' ortspec cache is a temporary folder (the
    shipped model copy lands there) whose measurements folder is this process's, so both runners read one cost
    curve."""
    from ortspec.adapters.engine.cache import cache_root

    cache = tmp_path_factory.mktemp("ray-cache")
    (cache_root() / "measurements").mkdir(parents=True, exist_ok=True)
    (cache / "measurements").symlink_to(cache_root() / "measurements", target_is_directory=True)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"ORTSPEC_CACHE": str(cache)}},
    )
    yield cache
    ray.shutdown()


def same_lines(a: dict, b: dict, *, stats: bool = True) -> None:
    """Every line equal; ``stats=False``: all but the speculation stats, which follow the draft widths the cost
    curve picks, measured per model path (a shipped copy has its own) and thread count."""
    assert a.keys() == b.keys()
    for key in a:
        if stats:
            assert same_record(a[key], b[key]), key
        else:
            assert same_record({**a[key], "stats": None}, {**b[key], "stats": None}), key


def test_ray_writes_what_the_embedded_runner_writes(local_ray, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS, [line for line, _ in BAD_LINES])
    embedded, on_ray = tmp_path / "embedded.jsonl", tmp_path / "ray.jsonl"
    kwargs = dict(model=tiny_model_dir, workers=2, threads=1, max_batch=3, options=DEFAULTS)
    run_batch(BatchJob(src, embedded, **kwargs), progress=False)
    summary = run_batch(BatchJob(src, on_ray, ray="local", **kwargs), progress=False)
    assert summary.mode == "ray" and summary.lost == 0 and summary.errors == len(BAD_LINES)
    assert summary.slots == 3  # each actor is one batched Engine (more records than its slots)
    assert summary.written == len(RECORDS) + len(BAD_LINES) and len(summary.load_s) >= 1
    same_lines(read_output(embedded), read_output(on_ray))


def test_ray_resumes_a_killed_run_with_the_model_shipped(local_ray, tiny_model_dir, tmp_path):
    records = [{"id": i, "prompt": f"record {i}: the lazy dog " * 3, "max_tokens": 20, "ignore_eos": True}
               for i in range(8)]  # fmt: skip
    records[3] = {**records[3], "temperature": 0.8, "seed": 99}
    src = write_jsonl(tmp_path / "in.jsonl", records)
    kwargs = dict(model=tiny_model_dir, workers=2, threads=1, options=DEFAULTS)
    embedded = read_output(_run(src, tmp_path / "embedded.jsonl", **kwargs))
    # OUTPUT as a kill leaves it: three records, and half of a fourth
    out = tmp_path / "ray.jsonl"
    lines = (tmp_path / "embedded.jsonl").read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:3]) + lines[3][:25])
    summary = run_batch(BatchJob(src, out, ray="local", ship_model=True, **kwargs), progress=False, log=lambda m: None)
    assert summary.skipped == 3 and summary.written == 5
    same_lines(read_output(out), embedded, stats=False)
    shipped = [p for p in (local_ray / "shipped").glob(f"{tiny_model_dir.name}-*") if p.is_dir()]
    assert len(shipped) == 1 and (shipped[0] / ".complete").is_file() and (shipped[0] / "model.onnx").is_file()


def _run(src, out, **kwargs):
    run_batch(BatchJob(src, out, **kwargs), progress=False)
    return out


@pytest.mark.real_model
def test_ray_equals_embedded_on_smollm2(local_ray, real_model_dir, tmp_path):
    from ortspec.adapters.cli.demo import DEMO_PROMPT

    records = [
        {"id": "code", "prompt": DEMO_PROMPT, "max_tokens": 48},
        {"id": "repeat", "prompt": "Repeat exactly: the cat sat on the mat, the dog on the log.", "max_tokens": 32},
        {"id": "haiku", "prompt": "Write a haiku about autumn leaves.", "max_tokens": 32, "speculative": None},
        {"id": "sampled", "prompt": "Name three rivers in Europe.", "max_tokens": 32, "temperature": 0.7,
         "top_p": 0.9, "seed": 2024},
        {"id": "chat", "messages": [{"role": "system", "content": "Answer in one word."},
                                    {"role": "user", "content": "What colour is the sky?"}], "max_tokens": 8},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", records)
    options = {**DEFAULTS, "chat": True}
    kwargs = dict(model=real_model_dir, workers=1, threads=2, options=options)
    embedded = read_output(_run(src, tmp_path / "embedded.jsonl", **kwargs))
    on_ray = read_output(_run(src, tmp_path / "ray.jsonl", ray="local", **kwargs))
    same_lines(embedded, on_ray)
    assert embedded['"code"']["stats"]["accepted"] > 0 and embedded['"sampled"']["seed"] == 2024
    assert all("error" not in r for r in embedded.values())
