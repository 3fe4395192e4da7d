"""Benchmark suite for ortspec: ``suite`` (the run's command line, ``python -m bench.suite``; ``suite_config``,
``suite_runs`` and ``suite_measurements`` hold its settings, its run and its measurements), ``engines`` (the engines
under test), ``report`` (records and summaries; ``report_tables`` and ``report_measurements`` the markdown's
sections, ``report_files`` the result files), ``limits`` (physical limits of a decode step), ``workloads`` (the
prompts; ``workloads_builders`` builds each category, ``workloads_text`` scans the standard library and keeps the
token budget), ``peers`` (peer-engine runners: ``peer_base``, ``peer_ortgenai``, ``peer_onnx_genai``), ``machine``
(machine facts) and ``replay``.

Each other benchmark has one entry point, ``python -m bench.<name>``, that writes its result file (the repository
keeps one current result per benchmark; git keeps the earlier runs): ``throughput`` (with ``throughput_dataset``,
``throughput_columns``, ``throughput_report``), ``batch_scaling``, ``generate_many`` (docs/), ``serve_load`` (with
``serve_load_server``, ``serve_load_clients``, ``serve_load_report``; docs/serve/), ``gpu`` (with ``gpu_models``,
``gpu_measure``, ``gpu_report``; docs/gpu/); and, writing to docs/bench/ as the suite does, ``ceiling`` (the
ceilings of ideal proposers on a run), ``batch_pass_cost`` (a batched pass against single-row passes),
``concurrent_streams`` (threads streaming on one Engine's shared passes), ``quantization`` (quantized folders:
exactness, speed, quality), ``structured_outputs`` (what constrained decoding costs), ``suffix`` (suffix drafting on
a repetitive stream, and the proposer's cost) and ``slots`` (ortspec's slots against ORT GenAI's batch sizes, on a
split of the throughput dataset).

Run from the repository root as a plain top-level package, e.g.
``python -m bench.workloads`` or ``python -m bench.machine``.
"""
