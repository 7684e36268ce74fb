"""Prometheus metrics of the server (``GET /metrics``), via ``prometheus-client``.

Names follow vLLM's where one exists (``num_requests_running``, ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``spec_decode_num_draft_tokens``, ...), under the
``specdecode_`` prefix. Each server has its own ``CollectorRegistry`` (no process-global
state: two servers in one process, as in the tests, do not share counts).
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine.stats import BatchStats
from specdecode.serve.openai_format import FINISH_REASONS

#: Seconds; the first token includes queueing and the prefill.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
#: Seconds between two deliveries of tokens to one request (a speculative round delivers a block).
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    """The server's counters, gauges and histograms, in their own registry.

    Attributes:
        registry: The ``CollectorRegistry`` rendered by ``render``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specdecode_requests", "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"], registry=r,
        )
        self.errors = Counter(
            "specdecode_request_errors", "Requests that ended in an error, by endpoint and OpenAI error type "
            "(a stream that fails after its 200 counts here too).", ["endpoint", "type"], registry=r,
        )
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("specdecode_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(
            "specdecode_request_success", "Choices (one per request with n = 1) that finished, by the finish "
            "reason the API reports (stop, length, content_filter).", ["finish_reason"], registry=r,
        )
        for reason in sorted(set(FINISH_REASONS.values())):
            self.finished.labels(reason)  # shown at 0 from the start
        self.cancelled = Counter(
            "specdecode_request_cancelled", "Choices cancelled before they finished: the client went away or the "
            "server shut down (never counted as a success).", registry=r,
        )
        self.failed = Counter(
            "specdecode_request_failed", "Choices whose generation failed in the engine (answered with a 500).",
            registry=r,
        )
        self.draft_tokens = Counter(
            "specdecode_spec_decode_num_draft_tokens", "Draft tokens proposed to the target.", registry=r
        )
        self.accepted_tokens = Counter(
            "specdecode_spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r
        )
        self.target_forwards = Counter(
            "specdecode_spec_decode_num_target_forwards", "Row-rounds of target verification (after the prefill).",
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "specdecode_spec_decode_acceptance_rate", "Accepted / drafted tokens over the server's life "
            "(NaN before anything was drafted).", registry=r,
        )
        self.running = Gauge("specdecode_num_requests_running", "Rows in the batch.", registry=r)
        self.waiting = Gauge("specdecode_num_requests_waiting", "Requests queued for a slot.", registry=r)
        self.ttft = Histogram(
            "specdecode_time_to_first_token_seconds", "Seconds from admission to the first token.",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "specdecode_inter_token_latency_seconds", "Seconds between successive token deliveries to a request "
            "(one observation per delivery; a delivery may carry several tokens).", buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "specdecode_e2e_request_latency_seconds", "Seconds from admission to the last token.",
            buckets=E2E_BUCKETS, registry=r,
        )
        self.step = Histogram(
            "specdecode_engine_step_seconds", "Seconds per engine step (admission + one round of all rows).",
            buckets=ITL_BUCKETS, registry=r,
        )
        self._seen = BatchStats()  # the engine's counts already added to the counters
        self.acceptance_rate.set(float("nan"))

    def observe_finish(self, engine_reason: str) -> None:
        """Count a choice that ended with the engine's ``engine_reason`` ("eos", "stop_string", "length",
        "banned_word", "cancelled", "error", ...): a success under the API's finish reason (``FINISH_REASONS``),
        else cancelled, else failed."""
        if engine_reason in FINISH_REASONS:
            self.finished.labels(FINISH_REASONS[engine_reason]).inc()
        elif engine_reason == "cancelled":
            self.cancelled.inc()
        else:
            self.failed.inc()

    def observe_engine(self, stats: BatchStats, running: int, waiting: int) -> None:
        """After an engine step (in the engine thread): add what the engine's lifetime counts
        gained since the last call (so cancelled and failed requests' rounds count too), and
        set the acceptance rate and the load gauges."""
        seen = self._seen
        self.generation_tokens.inc(stats.num_new_tokens - seen.num_new_tokens)
        self.draft_tokens.inc(stats.num_drafted_tokens - seen.num_drafted_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        self.target_forwards.inc(stats.num_row_rounds - seen.num_row_rounds)
        self._seen = dataclasses.replace(stats)
        if stats.num_drafted_tokens:
            self.acceptance_rate.set(stats.num_accepted_tokens / stats.num_drafted_tokens)
        self.set_load(running, waiting)

    def set_load(self, running: int, waiting: int) -> None:
        """Set the gauges of rows in the batch and requests waiting for one."""
        self.running.set(running)
        self.waiting.set(waiting)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
