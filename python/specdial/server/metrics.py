"""Prometheus metrics of the server (``GET /metrics``).

Each app owns a :class:`prometheus_client.CollectorRegistry` (several apps in one process never
collide). Every sample carries the label ``model_name`` (the served model name, as vLLM's),
added at scrape time to whatever the registry holds. Two sources:

- the engine, read at scrape time from :meth:`EngineProtocol.stats` by :class:`EngineCollector`
  (counters are the engine's cumulative totals);
- the server, measured per engine request: time to first token, time per output token and
  end-to-end latency histograms, and finished requests by reason.

Names follow vLLM's where vLLM has one (``vllm:`` -> ``specdial:``), in particular the
speculation counters; the mean acceptance length is ``1 + accepted_tokens / drafts`` and the draft
acceptance rate ``accepted_tokens / draft_tokens``. The prefix cache has vLLM's two counters
(``prefix_cache_queries``, ``prefix_cache_hits``: tokens; a windowed hit rate is
``rate(hits) / rate(queries)``) and SGLang's ``cache_hit_rate`` gauge, here since the engine
started (SGLang's is per prefill batch):

==========================================================  =======  ================================
name                                                        type     meaning
==========================================================  =======  ================================
``specdial:engine_up``                                      gauge    1 while the engine serves, 0
                                                                     once it failed (``/health``
                                                                     then answers 503)
``specdial:num_requests_running``                           gauge    requests in the running batch
``specdial:num_requests_waiting``                           gauge    requests queued for admission
``specdial:kv_cache_usage_perc``                            gauge    used / total KV pages (0..1)
``specdial:kv_cache_pages_used`` / ``_pages_total``         gauge    KV pages
``specdial:spec_decode_num_steps{slot}``                    gauge    current steps of each slot
                                                                     (label: its lowest batch size)
``specdial:spec_decode_predicted_iteration_seconds{steps}`` gauge    goodput: cost model's seconds
``specdial:spec_decode_policy_batch_size``                  gauge    goodput: batch of that figure
``specdial:spec_decode_acceptance_estimate{position}``      gauge    goodput: acceptance estimate
``specdial:spec_decode_policy_probes_total``                counter  goodput: probes run
``specdial:spec_decode_policy_off_pace_total``              counter  goodput: iterations not learned
                                                                     (machine off its usual pace)
``specdial:spec_decode_num_drafts_total``                   counter  request-verifies with drafts
``specdial:spec_decode_num_draft_tokens_total``             counter  draft tokens proposed
``specdial:spec_decode_num_accepted_tokens_total``          counter  draft tokens accepted
``specdial:spec_decode_num_accepted_tokens_per_pos_total``  counter  accepted per draft position
                                                                     (label ``position``, 0 = first)
``specdial:spec_decode_step_switches_total``                counter  steps changes of the policy
``specdial:num_preemptions_total``                          counter  requests preempted
``specdial:num_requests_finished_total``                    counter  requests the engine finished
``specdial:prompt_tokens_total``                            counter  prompt tokens of admitted
                                                                     requests (cached included)
``specdial:prefix_cache_queries_total``                     counter  prompt tokens looked up in
                                                                     the prefix cache (vLLM's)
``specdial:prefix_cache_hits_total``                        counter  prompt tokens served by the
                                                                     prefix cache (vLLM's)
``specdial:cache_hit_rate``                                 gauge    hits / queries since start
                                                                     (SGLang's name; 0 before any)
``specdial:prefix_cache_pages``                             gauge    KV pages the prefix cache
                                                                     holds now
``specdial:generation_tokens_total``                        counter  tokens generated
``specdial:request_success_total{finished_reason}``         counter  server requests by reason
``specdial:time_to_first_token_seconds``                    hist.    arrival -> first token
``specdial:time_per_output_token_seconds``                  hist.    (last - first token time) /
                                                                     (completion tokens - 1)
``specdial:e2e_request_latency_seconds``                    hist.    arrival -> finished
``specdial:request_queue_time_seconds``                     hist.    engine submission -> first
                                                                     prefill (waiting in the queue)
``specdial:inter_token_latency_seconds``                    hist.    gap between consecutive token
                                                                     deliveries of a request (one
                                                                     verify can deliver several)
==========================================================  =======  ================================

With ``dp_size > 1`` the series above sum the replicas; per-replica series (label ``dp_rank``)
and the router's queue: :mod:`specdial.server.replica_metrics`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specdial.server.replica_metrics import ReplicaCollector

__all__ = ["CONTENT_TYPE", "EngineCollector", "ServerMetrics"]

logger = logging.getLogger("specdial.server")

#: ``Content-Type`` of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class EngineCollector:
    """A custom collector reading ``engine.stats()`` at each scrape (see the module table).

    If ``stats()`` raises (e.g. the engine is shut down) the engine metrics are left out of
    that scrape, except ``specdial:engine_up`` (from the engine's optional ``failure``); the
    server's own metrics are still exported.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> Iterable[Metric]:
        return []  # no stats() call at registration

    def collect(self) -> Iterable[Metric]:
        failure = getattr(self.engine, "failure", None)  # optional in the engine contract
        yield GaugeMetricFamily("specdial:engine_up",
                                "1 while the engine can serve; 0 once it has failed (its loop "
                                "stopped, a tensor-parallel rank died; /health answers 503 "
                                "naming the cause).", value=0 if failure else 1)
        try:
            s = self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is gone
            logger.debug("engine.stats() failed during a metrics scrape", exc_info=True)
            return
        yield GaugeMetricFamily("specdial:num_requests_running",
                                "Requests in the running batch.", value=s.running)
        yield GaugeMetricFamily("specdial:num_requests_waiting",
                                "Requests waiting for admission.", value=s.queued)
        total = max(int(s.kv_pages_total), 0)
        yield GaugeMetricFamily("specdial:kv_cache_usage_perc",
                                "KV cache usage: used pages / total pages (1 = full).",
                                value=s.kv_pages_used / total if total else 0.0)
        yield GaugeMetricFamily("specdial:kv_cache_pages_used", "KV cache pages in use.",
                                value=s.kv_pages_used)
        yield GaugeMetricFamily("specdial:kv_cache_pages_total", "KV cache pages in the pool.",
                                value=s.kv_pages_total)
        steps = GaugeMetricFamily(
            "specdial:spec_decode_num_steps",
            "Current speculative_num_steps of each batch-size slot (label: the slot's lowest "
            "batch size).", labels=["slot"])
        for slot, k in sorted(s.steps_per_slot.items()):
            steps.add_metric([str(slot)], k)
        yield steps
        for name, doc, value in (
                ("spec_decode_num_drafts", "Request-verifies that carried drafts.", s.num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                 s.draft_tokens_proposed),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus tokens "
                 "excluded).", s.num_accepted_tokens),
                ("spec_decode_step_switches", "Changes of speculative_num_steps decided by the "
                 "policy.", s.step_switches),
                ("num_preemptions", "Requests preempted back to the queue.", s.preemptions),
                ("num_requests_finished", "Requests the engine finished.", s.requests_finished),
                ("prompt_tokens", "Prompt tokens of admitted requests, those served by the "
                 "prefix cache included.", s.prompt_tokens),
                ("generation_tokens", "Tokens generated.", s.generation_tokens)):
            yield CounterMetricFamily(f"specdial:{name}", doc, value=value)
        yield from self._prefix_cache(s)
        per_pos = CounterMetricFamily(
            "specdial:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            labels=["position"])
        for pos, n in enumerate(s.accepted_per_pos):
            per_pos.add_metric([str(pos)], n)
        yield per_pos
        lengths = CounterMetricFamily(
            "specdial:spec_decode_verify_length",
            "Request decode iterations of a chain by their verify length (drafts the request "
            "verified, its own budget; 0 = a plain decode through verify; draft trees: "
            "spec_decode_tree_nodes).", labels=["verify_length"])
        for v, n in sorted((getattr(s, "verify_length_histogram", None) or {}).items()):
            lengths.add_metric([str(v)], n)
        yield lengths
        # a tree's nodes are no verify length: their own family (vLLM's spec_decode_* counters
        # name one unit each: num_draft_tokens, num_accepted_tokens_per_pos{position})
        nodes = CounterMetricFamily(
            "specdial:spec_decode_tree_nodes",
            "Request decode iterations of a draft tree by the tree nodes the request verified "
            "(its kept nodes under a per-request node budget, else the tree's N; 0 = a plain "
            "decode through verify).", labels=["tree_nodes"])
        for v, n in sorted((getattr(s, "tree_node_histogram", None) or {}).items()):
            nodes.add_metric([str(v)], n)
        yield nodes
        yield from self._goodput(getattr(s, "goodput", None))

    @staticmethod
    def _prefix_cache(s: Any) -> Iterable[Metric]:
        """vLLM's prefix-cache counters, SGLang's hit-rate gauge and the pages held."""
        hits, queries = int(s.cached_tokens), int(s.prompt_tokens)
        yield CounterMetricFamily("specdial:prefix_cache_queries",
                                  "Prefix cache queries, in prompt tokens looked up (vLLM's "
                                  "name).", value=queries)
        yield CounterMetricFamily("specdial:prefix_cache_hits",
                                  "Prefix cache hits, in prompt tokens served from the cache "
                                  "(vLLM's name).", value=hits)
        yield GaugeMetricFamily("specdial:cache_hit_rate",
                                "Prefix cache hit rate since the engine started: hit tokens / "
                                "queried tokens (SGLang's name).",
                                value=hits / queries if queries else 0.0)
        yield GaugeMetricFamily("specdial:prefix_cache_pages",
                                "KV cache pages the prefix cache holds now.",
                                value=int(s.cached_pages))

    @staticmethod
    def _goodput(g: dict | None) -> Iterable[Metric]:
        """The goodput strategy's gauges: its cost model and acceptance estimates."""
        if not g:
            return
        yield CounterMetricFamily("specdial:spec_decode_policy_probes",
                                  "Probes of the goodput strategy: iterations run at steps that "
                                  "were not the predicted best, to measure a cost or acceptance.",
                                  value=g["probes"])
        yield CounterMetricFamily("specdial:spec_decode_policy_off_pace",
                                  "Decode iterations whose seconds the goodput strategy's cost "
                                  "model left out because the machine ran off its usual pace "
                                  "(other work slowing it).", value=g["off_pace_skipped"])
        acc = GaugeMetricFamily(
            "specdial:spec_decode_acceptance_estimate",
            "The goodput strategy's estimate of P(draft at this position accepted | the ones "
            "before it were), per draft position (0 = the first draft).", labels=["position"])
        for pos, a in enumerate(g["acceptance"]):
            acc.add_metric([str(pos)], a)
        yield acc
        last = g.get("last_decision")
        if not last:
            return
        pred = GaugeMetricFamily(
            "specdial:spec_decode_predicted_iteration_seconds",
            "Seconds of one decode iteration the goodput strategy's cost model predicts at the "
            "latest decision's batch size and context, per speculative_num_steps.",
            labels=["steps"])
        for k, t in sorted(last["predicted_seconds"].items()):
            pred.add_metric([str(k)], t)
        yield pred
        yield GaugeMetricFamily("specdial:spec_decode_policy_batch_size",
                                "Batch size (padded to the CUDA-graph size) of that decision.",
                                value=last["batch_size"])


class _ModelNameLabel:
    """A collector re-exporting every metric of ``inner`` with ``model_name`` added to each
    sample's labels."""

    def __init__(self, inner: CollectorRegistry, model_name: str) -> None:
        self.inner, self.model_name = inner, model_name

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        for metric in self.inner.collect():
            metric.samples = [s._replace(labels={**s.labels, "model_name": self.model_name})
                              for s in metric.samples]
            yield metric


class ServerMetrics:
    """The registry of one app: the engine collector plus per-request histograms (seconds);
    ``model_name`` labels every sample."""

    def __init__(self, engine: Any, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self._exported = CollectorRegistry()
        self._exported.register(_ModelNameLabel(self.registry, model_name))  # type: ignore[arg-type]
        self.registry.register(EngineCollector(engine))  # type: ignore[arg-type]
        self.registry.register(ReplicaCollector(engine))  # type: ignore[arg-type]
        self.ttft = Histogram("specdial:time_to_first_token_seconds",
                              "Time from request arrival to its first token, seconds.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("specdial:time_per_output_token_seconds",
                              "Time per output token after the first, seconds.",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specdial:e2e_request_latency_seconds",
                             "Time from request arrival to its last token, seconds.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("specdial:request_queue_time_seconds",
                                    "Time a request waited between its submission to the "
                                    "engine and its first prefill, seconds.",
                                    buckets=_E2E_BUCKETS, registry=self.registry)
        self.itl = Histogram("specdial:inter_token_latency_seconds",
                             "Time between consecutive token deliveries of a request "
                             "(a verify can deliver several tokens at once), seconds.",
                             buckets=_TPOT_BUCKETS, registry=self.registry)
        self.finished = Counter("specdial:request_success",
                                "Engine requests served to the end, by finish reason "
                                "(stop, length, abort).", ["finished_reason"],
                                registry=self.registry)

    def observe_first_token(self, seconds: float) -> None:
        """Record one request's time to first token."""
        self.ttft.observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        """Record one request's time in the engine's queue (submission -> first prefill)."""
        self.queue_time.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        """Record the gap between two consecutive token deliveries of one request."""
        self.itl.observe(seconds)

    def observe_finished(self, *, reason: str, e2e_s: float, first_token_s: float | None,
                         completion_tokens: int) -> None:
        """Record a finished request: its reason, end-to-end latency and, with 2+ tokens, the
        time per output token ``(e2e_s - first_token_s) / (completion_tokens - 1)``."""
        self.finished.labels(finished_reason=reason).inc()
        self.e2e.observe(e2e_s)
        if first_token_s is not None and completion_tokens > 1:
            self.tpot.observe(max(e2e_s - first_token_s, 0.0) / (completion_tokens - 1))

    def render(self) -> bytes:
        """The text exposition of every metric (calls ``engine.stats()`` once)."""
        return generate_latest(self._exported)
