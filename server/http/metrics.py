"""Prometheus metrics, one :class:`CollectorRegistry` per app (tests run several apps)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from qswap.guard import GuardRecord, GuardStatus

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STAGE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class FunctionCounter(Collector):
    """A counter whose value a callback reads at scrape time (a count kept elsewhere, e.g. by the
    capture writer): exported as ``<name>_total`` with the counter type, as dashboards expect.
    With ``label``, the callback returns a count per value of that label."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry,
                 label: str | None = None) -> None:
        self._name, self._doc, self._label = name, documentation, label
        self._read: Callable[[], Any] | None = None
        registry.register(self)

    def set_function(self, read: Callable[[], float] | Callable[[], Mapping[str, float]]) -> None:
        """Read the count (with a label: ``{label value: count}``), never decreasing, from ``read`` from now on."""
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self._label is None:
            yield CounterMetricFamily(self._name, self._doc, value=float(self._read() if self._read else 0))
            return
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in sorted((self._read() if self._read else {}).items()):
            family.add_metric([value], float(count))
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield (CounterMetricFamily(self._name, self._doc, value=0) if self._label is None
               else CounterMetricFamily(self._name, self._doc, labels=[self._label]))


class Metrics:
    """Every metric the server exports (names prefixed ``qswap_``)."""

    def __init__(self) -> None:
        # The *_created series double the output and no dashboard uses them (process-wide switch).
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        # process_* (CPU, RSS, open files), python_info and python_gc_*: what every Prometheus job shows.
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(standard)
        self.requests = Counter("qswap_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("qswap_request_duration_seconds",
                                         "HTTP request latency by route and encoder (empty for non-search)",
                                         ["route", "encoder"], buckets=_LATENCY, registry=r)
        self.queue_seconds = Histogram("qswap_queue_seconds", "time a search waited for its batch",
                                       buckets=_STAGE, registry=r)
        self.encode_seconds = Histogram("qswap_encode_seconds", "forward pass per batch",
                                        buckets=_STAGE, registry=r)
        self.search_seconds = Histogram("qswap_search_seconds", "index search per batch",
                                        buckets=_STAGE, registry=r)
        self.batch_size = Histogram("qswap_batch_size", "queries per encoded batch", buckets=_BATCH, registry=r)
        self.batch_requests = Histogram("qswap_batch_requests", "requests merged into one batch",
                                        buckets=_BATCH, registry=r)
        self.queries = Counter("qswap_queries", "queries searched, by encoder", ["encoder"], registry=r)
        self.embedded = Counter("qswap_embedded_inputs", "inputs embedded (/v1/embeddings, /tei), by encoder "
                                "('qswap/documents' for the document tower)", ["encoder"], registry=r)
        self.truncated = Counter("qswap_truncated_queries", "queries cut to the model's max tokens", registry=r)
        self.encoders_loaded = Gauge("qswap_encoders_loaded", "query encoders attached to the base", registry=r)
        self.encoders_loaded_bytes = Gauge("qswap_encoders_loaded_bytes",
                                           "bytes the loaded adapters add to the base", registry=r)
        self.runtime_builds = FunctionCounter("qswap_runtime_builds", "runtimes the query backend started "
                                              "building in the background, by kind (graphs, sessions, merged "
                                              "exports: the kinds GET /readyz lists in warming)", r, label="kind")
        self.encoders_registered = Gauge("qswap_encoders_registered", "encoders in the registry", registry=r)
        self.registrations = Counter("qswap_encoder_registrations", "encoder registrations by result",
                                     ["result"], registry=r)
        self.loads = Counter("qswap_encoder_loads", "encoders loaded into memory", registry=r)
        self.evictions = Counter("qswap_encoder_evictions", "encoders evicted by the memory budget", registry=r)
        self.errors = Counter("qswap_errors", "error responses by error code and status",
                              ["code", "status"], registry=r)
        self.rejected = Counter("qswap_rejected_requests", "requests refused at admission, by reason "
                                "(queue_full, encoder_queue_full, abandoned_before: 429; shutting_down: 503; "
                                "client_gone: the client went away, 499)", ["reason"], registry=r)
        self.expired = Counter("qswap_expired_requests", "requests dropped at their deadline (504), by where "
                               "they were (queued: never ran; waiting: the caller stopped waiting)",
                               ["stage"], registry=r)
        self.admitted = Gauge("qswap_admitted_requests", "requests admitted and not finished", registry=r)
        self.index_documents = Gauge("qswap_index_documents", "documents in the index", registry=r)
        self.ready = Gauge("qswap_ready", "1 once the index and the default encoder are loaded", registry=r)
        # The server's own guard (--sentinels): one series per (encoder, sentinel, reference).
        _g = ["encoder", "sentinel", "against"]
        self.guard_passed = Gauge("qswap_guard_passed", "1 when the encoder passed the server's sentinel "
                                  "evaluation, 0 when refused or failed", ["encoder"], registry=r)
        self.guard_ndcg = Gauge("qswap_guard_ndcg_at_10", "mean nDCG@10 on a sentinel, before (the reference "
                                "encoder) and after (the evaluated one)", [*_g, "side"], registry=r)
        self.guard_p = Gauge("qswap_guard_p_value", "Holm-adjusted Wilcoxon p of the nDCG@10 change",
                             _g, registry=r)
        self.guard_regressed = Gauge("qswap_guard_regressed", "1 when the sentinel is significantly worse",
                                     _g, registry=r)
        self.guard_queries = Gauge("qswap_guard_queries", "sentinel queries scored", _g, registry=r)
        self.guard_seconds = Histogram("qswap_guard_evaluation_seconds", "one encoder's sentinel evaluation",
                                       buckets=(1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 300, 600), registry=r)
        self._guard_labels: dict[str, list[tuple[str, str, str]]] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # Learning from traffic (--feedback-dir): capture and online experiments per domain.
        self.feedback = Counter("qswap_feedback", "feedback received on captured searches, by result "
                                "(recorded, refused)", ["result"], registry=r)
        self.captured = Counter("qswap_captured_impressions", "query impressions queued for capture", registry=r)
        self.capture_dropped = FunctionCounter("qswap_capture_dropped", "impressions not captured (the writer fell "
                                               "behind or the disk failed)", registry=r)
        self.experiment_impressions = Gauge("qswap_experiment_impressions",
                                            "interleaved impressions of the domain's experiment", ["domain"], registry=r)
        self.experiment_outcomes = Gauge("qswap_experiment_outcomes", "feedback outcomes of the domain's "
                                         "experiment (wins: candidate credited)", ["domain", "outcome"], registry=r)
        self.experiment_p_value = Gauge("qswap_experiment_p_value", "two-sided sign test of wins against losses",
                                        ["domain"], registry=r)
        self.experiment_shadow_runs = Gauge("qswap_experiment_shadow_runs", "shadow runs done", ["domain"],
                                            registry=r)
        self.experiment_overlap = Gauge("qswap_experiment_overlap", "mean rank-biased overlap of control and "
                                        "candidate top-k (shadow)", ["domain"], registry=r)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)`` (values in the metric's label order), remembered: the hot
        routes count every request, and ``labels`` takes a lock and checks its arguments each
        time. Only for series that are never removed (the per-request counters and histograms).

        Args:
            metric: one of this object's labelled counters or histograms.
            values: its label values, in its label order.

        Returns:
            The child series to ``inc`` or ``observe``.
        """
        key = (metric, values)
        got = self._children.get(key)
        if got is None:   # two threads may both ask: labels returns the same child to both
            got = self._children[key] = metric.labels(*values)
        return got

    def export_guard(self, key: str, record: GuardRecord, status: GuardStatus, seconds: float | None = None) -> None:
        """Publish one encoder's guard verdict (replacing its previous series)."""
        self.unexport_guard(key)
        self.guard_passed.labels(encoder=key).set(1 if status == GuardStatus.PASSED else 0)
        if seconds is not None:
            self.guard_seconds.observe(seconds)
        labels = []
        for c in record.checks:
            lab = (key, c.name, c.against)
            labels.append(lab)
            if c.judged:   # else too few queries were left to compare (insufficient evidence)
                self.guard_ndcg.labels(*lab, "before").set(c.before)
                self.guard_ndcg.labels(*lab, "after").set(c.after)
                self.guard_p.labels(*lab).set(c.p_holm)
            self.guard_regressed.labels(*lab).set(1 if c.degraded else 0)
            self.guard_queries.labels(*lab).set(c.n or 0)
        self._guard_labels[key] = labels

    def unexport_guard(self, key: str) -> None:
        """Drop an encoder's guard series (deleted or re-evaluated)."""
        for lab in self._guard_labels.pop(key, []):
            for g in (self.guard_p, self.guard_regressed, self.guard_queries):
                try:
                    g.remove(*lab)
                except KeyError:
                    pass
            for side in ("before", "after"):
                try:
                    self.guard_ndcg.remove(*lab, side)
                except KeyError:
                    pass
        try:
            self.guard_passed.remove(key)
        except KeyError:
            pass

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
