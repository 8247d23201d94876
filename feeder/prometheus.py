"""``PrometheusLogger``: an external logger that publishes each feed's metrics to Prometheus.

Usage::

    import prometheus_client, feeder

    prom = feeder.PrometheusLogger()                       # default: prometheus_client.REGISTRY
    feeder.init_data_input_workers(session, ["x"], fetch, 64, input_source_name="train",
                                   external_loggers=[prom], log_interval=10.0)
    prometheus_client.start_http_server(8000)              # your exporter: feeder opens no socket

Every metric of ``feed.metrics()`` becomes a series ``<namespace>_<metric>`` with one label,
``source`` (the feed's ``input_source_name``), as the contract says. Data-parallel replicas of a
source are added up into the source's series: their per-feed counts and rates are summed,
and what is the source's own (``source_*``, ``queue_size``, ``queue_capacity``,
``live_workers``, ``batch_size``, ``uptime_s``: ``feeder.feedstats.SOURCE_KEYS``) is taken
once. Every series is a gauge, so that its name is exactly ``<namespace>_<metric>`` (a
Prometheus counter would be exposed as ``<namespace>_<metric>_total``). The totals (``batches``,
``rows``, ``fetch_calls``, the stage times ``fetch_s``, ``consumer_run_s``, ..., the ledger's
``source_rows_*``: ``feeder.feedstats.TOTALS``) still never go back: what feeds that stopped
contributed stays in them, and so does what earlier registrations of the source (earlier
generations of its queue, before a stop) counted, so ``rate()`` and ``increase()`` work on them
as on counters. Values of the moment (rates, queue sizes) follow the feeds still running.
Values are the feeds' latest reports (every ``log_interval`` and at stop): a scrape never
touches the feeds' threads.

The collector declares every family it may ever yield (``describe()``, from
``feeder.feedstats.REPORT_KEYS``), so a name that another collector of the registry already
has (a gauge of your own called ``feeder_batches``, or a logger whose namespace overlaps, such
as ``feeder_source`` beside ``feeder``) makes creating the logger raise prometheus_client's
usual ``ValueError`` instead of duplicating families in the exposition.

How the feed tells the logger its source: ``PrometheusLogger`` sets ``log_with_feed = True``,
so the feed calls ``log(metrics, feed=feed)`` instead of ``log(metrics)`` (see
``feeder.metrics.send_to_external_loggers``); plain loggers are called as before.

One collector is registered per (registry, namespace) and shared by every ``PrometheusLogger``
made for that pair, so several loggers may share a registry, and one logger may serve any
number of registrations. prometheus_client is imported only when a logger is created
(``pip install 'onnx-feeder[prometheus]'``).
"""
from __future__ import annotations

import itertools
import re
import threading
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional

from .feedstats import REPORT_KEYS, SOURCE_KEYS, TOTALS

LABELS = ("source",)

_INSTALL_HINT = "PrometheusLogger needs prometheus_client: pip install 'onnx-feeder[prometheus]'"
_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(namespace: str, key: str) -> str:
    """``<namespace>_<key>`` with characters Prometheus does not allow replaced by ``_``."""
    name = _BAD_CHARS.sub("_", f"{namespace}_{key}" if namespace else key)
    return "_" + name if name[0].isdigit() else name


def _source_level(key: str) -> bool:
    return key.startswith("source_") or key in SOURCE_KEYS


class _Report:
    __slots__ = ("source", "metrics", "seq", "feed", "generation")

    def __init__(self, source: str, metrics: Dict[str, float], seq: int, feed: Any, generation: Any):
        self.source, self.metrics, self.seq, self.feed = source, metrics, seq, feed
        self.generation = generation  # which queue of the source (a new one after each stop)

    def live(self) -> bool:
        feed = self.feed() if self.feed is not None else None
        return feed is not None and not getattr(feed, "_stopped", False)


class _Collector:
    """The latest report of every feed seen, added up per source and yielded on a scrape."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._lock = threading.Lock()
        self._seq = itertools.count()
        # One entry per feed ever seen, kept after the feed is gone so that counters never go
        # back; a feed is told apart by a token tied to it weakly (ids can be reused).
        self._reports: Dict[Any, _Report] = {}
        self._tokens: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def update(self, source: str, feed: Any, metrics: Mapping[str, float]) -> None:
        snapshot = {str(k): float(v) for k, v in metrics.items()}
        with self._lock:
            seq = next(self._seq)
            token: Any = ("by hand", source)
            ref = None
            generation = None
            if feed is not None:
                try:
                    token = self._tokens.setdefault(feed, seq)
                    ref = weakref.ref(feed)
                except TypeError:  # not weak-referenceable: one entry per source
                    pass
                queue = getattr(feed, "source", None)  # a feed's queue: one per generation of a source
                if queue is not None:
                    try:
                        generation = self._tokens.setdefault(queue, seq)
                    except TypeError:
                        pass
            self._reports[token] = _Report(source, snapshot, seq, ref, generation)

    def values(self) -> Dict[str, Dict[str, float]]:
        """{source: {metric: value}}, replicas added up (see the module docstring)."""
        with self._lock:
            reports = list(self._reports.values())
        by_source: Dict[str, List[_Report]] = {}
        for r in reports:
            by_source.setdefault(r.source, []).append(r)
        out: Dict[str, Dict[str, float]] = {}
        for source, rs in by_source.items():
            latest = max(rs, key=lambda r: r.seq)
            live = [r for r in rs if r.live()] or [latest]
            values: Dict[str, float] = {}
            for key in sorted({k for r in rs for k in r.metrics}):
                have = [r for r in rs if key in r.metrics]
                if key in TOTALS and _source_level(key):
                    # Replicas of one generation report the same ledger (the largest is the
                    # latest: it only grows); each generation after a stop starts from 0.
                    by_generation: Dict[Any, float] = {}
                    for r in have:
                        by_generation[r.generation] = max(by_generation.get(r.generation, 0.0), r.metrics[key])
                    values[key] = sum(by_generation.values())
                elif key in TOTALS:  # every feed ever seen, stopped ones included
                    values[key] = sum(r.metrics[key] for r in have)
                elif _source_level(key):
                    values[key] = max(have, key=lambda r: r.seq).metrics[key]
                else:
                    values[key] = sum(r.metrics.get(key, 0.0) for r in live)
            out[source] = values
        return out

    def _family(self, key: str) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        what = "total so far, only grows" if key in TOTALS else "latest value"
        return GaugeMetricFamily(metric_name(self.namespace, key), f"feeder metric {key!r} ({what})", labels=LABELS)

    def describe(self) -> List[Any]:
        """Every family this collector may yield, so that the registry refuses a name clash
        when the collector is registered (prometheus_client's ValueError)."""
        return [self._family(key) for key in REPORT_KEYS]

    def collect(self) -> Iterator[Any]:
        values = sorted(self.values().items())
        for key in sorted({k for _, m in values for k in m}):
            family = self._family(key)
            for source, m in values:
                if key in m:
                    family.add_metric([source], m[key])
            yield family


_COLLECTORS_ATTR = "_feeder_prometheus_collectors"  # on the registry: {namespace: _Collector}
_registering = threading.Lock()  # guards creating a registry's collector; holds no data


def _collector_for(registry: Any, namespace: str) -> _Collector:
    """The registry's collector for ``namespace``, shared by every logger of that pair. It is
    kept on the registry itself, so the library holds no state about registries."""
    with _registering:
        by_ns: Dict[str, _Collector] = registry.__dict__.setdefault(_COLLECTORS_ATTR, {})
        collector = by_ns.get(namespace)
        if collector is None:
            collector = _Collector(namespace)
            registry.register(collector)
            by_ns[namespace] = collector
        return collector


class PrometheusLogger:
    """An external logger that publishes feeds' metrics in a Prometheus registry the user owns.

    Pass the logger in ``external_loggers`` of any number of registrations: each key of
    ``feed.metrics()`` becomes the series ``<namespace>_<key>``, labelled ``source="<name>"``.
    feeder never serves the registry: that is yours (``prometheus_client.start_http_server``).

    Args:
        registry: A ``prometheus_client.CollectorRegistry``; None: ``prometheus_client.REGISTRY``.
        namespace: The prefix of every series name (a valid Prometheus name prefix).

    Raises:
        ImportError: prometheus_client (the ``prometheus`` extra) is not installed.
        ValueError: A ``namespace`` that is not a valid prefix, or one whose series another
            collector of the registry already has.
    """

    log_with_feed = True  # the feed calls log(metrics, feed=feed); see feeder.metrics

    def __init__(self, registry: Optional[Any] = None, namespace: str = "feeder"):
        try:
            import prometheus_client
        except ImportError as e:
            raise ImportError(_INSTALL_HINT) from e
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        if namespace and not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", namespace):
            raise ValueError(f"namespace must be a valid Prometheus metric name prefix, got {namespace!r}")
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.namespace = namespace
        self._collector = _collector_for(self.registry, namespace)

    def log(self, metrics: Mapping[str, float], feed: Any = None, source: Optional[str] = None) -> None:
        """Record ``metrics`` as the latest values of a source (feeds call this at every report).

        Args:
            metrics: A feed's metrics, ``{key: value}``.
            feed: The feed reporting them; its ``input_source_name`` labels the series, and
                replicas of a source add up.
            source: The label when called by hand without a feed; None: ``"unknown"``.
        """
        if feed is not None:
            source = feed.input_source_name
        self._collector.update("unknown" if source is None else str(source), feed, metrics)

    def __repr__(self) -> str:
        return f"PrometheusLogger(namespace={self.namespace!r})"
