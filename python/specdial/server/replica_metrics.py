"""Per-replica Prometheus series of a data-parallel engine (``dp_size > 1``), label ``dp_rank``.

The summed series (:class:`~specdial.server.metrics.EngineCollector`) stay as they are; this
collector adds, at each scrape, one series per replica, read by the router in this process
(each replica process answers ``stats()`` over its connection; no Prometheus multiprocess
directory), and the router's own view:

======================================================  =======  ==============================
name                                                    type     meaning
======================================================  =======  ==============================
``specdial:replica_up{dp_rank}``                        gauge    1 serving, 0 failed (``/health``
                                                                 names it)
``specdial:replica_num_requests_running{dp_rank}``      gauge    its running batch
``specdial:replica_num_requests_waiting{dp_rank}``      gauge    its admission queue
``specdial:replica_kv_cache_usage_perc{dp_rank}``       gauge    its used / total KV pages
``specdial:replica_num_requests_finished_total``        counter  requests it finished
``specdial:replica_generation_tokens_total``            counter  tokens it generated
``specdial:router_requests_in_flight{dp_rank}``         gauge    requests the router sent there
                                                                 that have not ended
``specdial:router_outstanding_tokens{dp_rank}``         gauge    their prompt + max_new_tokens
                                                                 (what ``minimum_tokens`` routes
                                                                 by)
======================================================  =======  ==============================

It reads the engine's ``data_parallel`` front (or the engine itself when it is one) by duck
typing: ``replicas``, ``live_stats()`` and ``router.snapshot()``; other engines add nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["ReplicaCollector"]


def _front(engine: Any) -> Any:
    front = getattr(engine, "data_parallel", None)
    if front is None and hasattr(engine, "live_stats") and hasattr(engine, "router"):
        front = engine
    return front


class ReplicaCollector:
    """The table above, for ``engine`` (a scrape never fails because of a replica)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        front = _front(self.engine)
        if front is None:
            return
        live = front.live_stats()
        inflight, work = front.router.snapshot()
        label = ["dp_rank"]
        up = GaugeMetricFamily("specdial:replica_up", "1 while the data-parallel replica "
                               "serves; 0 once it failed.", labels=label)
        fams = {
            "running": GaugeMetricFamily("specdial:replica_num_requests_running",
                                         "Requests in the replica's running batch.",
                                         labels=label),
            "queued": GaugeMetricFamily("specdial:replica_num_requests_waiting",
                                        "Requests waiting for the replica's admission.",
                                        labels=label),
            "kv": GaugeMetricFamily("specdial:replica_kv_cache_usage_perc",
                                    "The replica's KV cache usage (used / total pages).",
                                    labels=label),
            "requests_finished": CounterMetricFamily(
                "specdial:replica_num_requests_finished", "Requests the replica finished.",
                labels=label),
            "generation_tokens": CounterMetricFamily(
                "specdial:replica_generation_tokens", "Tokens the replica generated.",
                labels=label)}
        queue = GaugeMetricFamily("specdial:router_requests_in_flight", "Requests the router "
                                  "sent to the replica that have not ended.", labels=label)
        tokens = GaugeMetricFamily("specdial:router_outstanding_tokens", "Prompt plus "
                                   "max_new_tokens of those requests (the router's load "
                                   "figure).", labels=label)
        for i in range(len(front.replicas)):
            rank = [str(i)]
            up.add_metric(rank, 1 if i in live else 0)
            queue.add_metric(rank, inflight[i])
            tokens.add_metric(rank, work[i])
            s = live.get(i)
            if s is None:
                continue
            total = max(int(s.kv_pages_total), 0)
            fams["kv"].add_metric(rank, s.kv_pages_used / total if total else 0.0)
            for key in ("running", "queued", "requests_finished", "generation_tokens"):
                fams[key].add_metric(rank, getattr(s, key))
        yield up
        yield from fams.values()
        yield queue
        yield tokens
