"""``PrometheusLogger``: an external logger that publishes each feed's metrics to Prometheus.

Usage::

    import prometheus_client, feeder

    prom = feeder.PrometheusLogger()                       # default: prometheus_client.REGISTRY
    feeder.init_data_input_workers(session, ["x"], fetch, 64, input_source_name="train",
                                   external_loggers=[prom], log_interval=10.0)
    prometheus_client.start_http_server(8000)              # your exporter: feeder opens no socket

Every metric of ``feed.metrics()`` becomes a series ``<namespace>_<metric>`` with the labels
``source`` (the feed's ``input_source_name``) and ``replica`` (0 for the first feed of that
source that reported to this registry, 1 for the next, ...; data-parallel replicas each have
their own counters). Monotonic totals (``batches``, ``rows``, ``fetch_calls``,
``bytes_delivered``, ...) are counters, exposed with Prometheus' ``_total`` suffix
(``feeder_batches_total``); the rest are gauges. Values are the feed's latest report (every
``log_interval`` and at stop): a scrape never touches the feed's threads.

How the feed tells the logger its source: ``PrometheusLogger`` sets ``log_with_feed = True``,
so the feed calls ``log(metrics, feed=feed)`` instead of ``log(metrics)`` (see
``feeder.metrics.send_to_external_loggers``); plain loggers are called as before.

One collector is registered per (registry, namespace) and shared by every ``PrometheusLogger``
made for that pair, so several loggers may share a registry, and one logger may serve any
number of registrations. prometheus_client is imported only when a logger is created
(``pip install 'feeder[prometheus]'``).
"""
from __future__ import annotations

import re
import threading
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

# Keys of feed.metrics() that only ever grow while a feed lives: Prometheus counters.
COUNTERS = frozenset({
    "batches", "rows", "chunks_fetched", "rows_fetched", "fetch_calls", "none_chunks", "empty_chunks",
    "fetch_errors", "rows_dropped", "consumer_wait_s", "source_rows_fetched", "source_rows_delivered",
    "source_rows_dropped", "source_rows_discarded", "buffer_allocations", "bytes_delivered", "bytes_copied",
    "zero_copy_batches",
})
LABELS = ("source", "replica")

_INSTALL_HINT = "PrometheusLogger needs prometheus_client: pip install 'feeder[prometheus]'"
_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(namespace: str, key: str) -> str:
    """``<namespace>_<key>`` with characters Prometheus does not allow replaced by ``_``."""
    name = _BAD_CHARS.sub("_", f"{namespace}_{key}" if namespace else key)
    return "_" + name if name[0].isdigit() else name


class _Collector:
    """The latest metrics of every (source, replica) seen, yielded as metric families on a scrape."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._lock = threading.Lock()
        self._latest: Dict[Tuple[str, str], Dict[str, float]] = {}
        # feed -> its replica index; weak so that a feed that is gone frees its index for the
        # next registration of the same source (which then continues that series).
        self._replicas: "weakref.WeakKeyDictionary[Any, Tuple[str, str]]" = weakref.WeakKeyDictionary()

    def update(self, source: str, feed: Any, metrics: Mapping[str, float]) -> None:
        snapshot = {str(k): float(v) for k, v in metrics.items()}
        with self._lock:
            key = self._key(source, feed)
            self._latest[key] = snapshot

    def _key(self, source: str, feed: Any) -> Tuple[str, str]:
        if feed is None:
            return (source, "0")
        try:
            key = self._replicas.get(feed)
        except TypeError:  # not weak-referenceable: treat as the source's only feed
            return (source, "0")
        if key is None or key[0] != source:
            taken = {k[1] for k in self._replicas.values() if k[0] == source}
            index = next(i for i in range(len(taken) + 1) if str(i) not in taken)
            key = (source, str(index))
            self._replicas[feed] = key
        return key

    def describe(self) -> List[Any]:
        return []  # names appear as sources report; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            latest = sorted(self._latest.items())
        keys = sorted({k for _, m in latest for k in m})
        for key in keys:
            name = metric_name(self.namespace, key)
            if key in COUNTERS:
                family: Any = CounterMetricFamily(name, f"feeder metric {key!r} (total)", labels=LABELS)
            else:
                family = GaugeMetricFamily(name, f"feeder metric {key!r}", labels=LABELS)
            for (source, replica), m in latest:
                if key in m:
                    family.add_metric([source, replica], m[key])
            yield family


_collectors_lock = threading.Lock()
_collectors: "weakref.WeakKeyDictionary[Any, Dict[str, _Collector]]" = weakref.WeakKeyDictionary()


def _collector_for(registry: Any, namespace: str) -> _Collector:
    with _collectors_lock:
        by_ns = _collectors.setdefault(registry, {})
        collector = by_ns.get(namespace)
        if collector is None:
            collector = _Collector(namespace)
            registry.register(collector)
            by_ns[namespace] = collector
        return collector


class PrometheusLogger:
    """An external logger that publishes feeds' metrics in a Prometheus registry the user owns.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (None: ``prometheus_client.REGISTRY``).
    ``namespace``: the prefix of every series name. Pass the logger in ``external_loggers`` of
    any number of registrations; see the module docstring for names and labels.
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
        """Record ``metrics`` as the latest values of ``feed``'s source (or of ``source``, when
        called by hand without a feed; default ``"unknown"``)."""
        if feed is not None:
            source = feed.input_source_name
        self._collector.update("unknown" if source is None else str(source), feed, metrics)

    def __repr__(self) -> str:
        return f"PrometheusLogger(namespace={self.namespace!r})"
