"""The server's Prometheus metrics (``GET /metrics``, text format), in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ortspec.driver import GenerateResult

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows per batched pass


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ortspec_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("ortspec_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter(
            "ortspec_cached_prompt_tokens", "prompt tokens whose KV was reused (prefix reuse)", registry=r
        )
        self.completion_tokens = Counter("ortspec_completion_tokens", "generated tokens", registry=r)
        self.passes = Counter("ortspec_target_passes", "target model passes (stats.steps)", registry=r)
        self.proposed = Counter("ortspec_draft_tokens_proposed", "draft tokens proposed for verification", registry=r)
        self.accepted = Counter("ortspec_draft_tokens_accepted", "draft tokens accepted", registry=r)
        self.generations = Counter(
            "ortspec_generations",
            "generations by outcome (finished, cancelled, timeout, error)",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter("ortspec_rejected", "requests refused because the queue was full", registry=r)
        self.queue_wait = Histogram("ortspec_queue_wait_seconds", "time waiting for a slot", registry=r)
        self.ttft = Histogram(
            "ortspec_time_to_first_token_seconds", "request arrival to the first generated token", registry=r
        )
        self.duration = Histogram("ortspec_generation_seconds", "time a request held a slot", registry=r)
        self.waiting = Gauge("ortspec_queue_depth", "requests waiting for a slot", registry=r)
        self.busy = Gauge("ortspec_workers_busy", "slots running a generation", registry=r)
        self.workers = Gauge("ortspec_workers", "engines serving (1; with --ray, the replicas)", registry=r)
        self.batch_slots = Gauge("ortspec_batch_slots", "slots of an engine", registry=r)
        self.batch_rows = Histogram(
            "ortspec_batch_rows", "sequences in each batched pass", buckets=ROW_BUCKETS, registry=r
        )
        self.batch_decoding_rows = Histogram(
            "ortspec_batch_decoding_rows",
            "sequences past their prompt (decoding) in each batched pass",
            buckets=ROW_BUCKETS,
            registry=r,
        )

    def record_pass(self, rows: int, decoding: int) -> None:
        """One batched pass of ``rows`` sequences, ``decoding`` of them past their prompt."""
        self.batch_rows.observe(rows)
        self.batch_decoding_rows.observe(decoding)

    def record(self, result: GenerateResult) -> None:
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_prompt_tokens.inc(result.cached_prompt_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        self.passes.inc(result.stats.steps)
        self.proposed.inc(result.stats.proposed_tokens)
        self.accepted.inc(result.stats.accepted_tokens)
