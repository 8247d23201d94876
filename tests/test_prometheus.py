"""PrometheusLogger: series names, labels and values, scraped from a real exporter on 127.0.0.1."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import feeder

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def chunk(worker_id, batch_size):
    return [np.ones((3, 2), np.float32)]


def scrape(registry) -> dict:
    """Serve ``registry`` on an ephemeral port of 127.0.0.1, scrape it once, shut the server down.
    Returns {sample name: {source: value}} and the family types; every sample's labels must be
    exactly {"source": ...}, as API.md says."""
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert not thread.is_alive()
    samples, types = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            assert set(s.labels) == {"source"}, s
            samples.setdefault(s.name, {})[s.labels["source"]] = s.value
    return {"samples": samples, "types": types}


def test_scrape_shows_each_source_with_its_values(coord):
    registry = prometheus_client.CollectorRegistry()
    prom = feeder.PrometheusLogger(registry=registry)
    for name in ("train", "test"):
        feeder.init_data_input_workers(None, ["x"], chunk, 4, num_worker_threads=1, input_source_name=name,
                                       external_loggers=[prom], coordinator=coord)
    coord.start()
    taken = {"train": 5, "test": 2}
    for name, n in taken.items():
        for _ in range(n):
            coord.feed(name).next_batch(timeout=10)
    assert coord.stop()  # the final report reaches the logger before stop() returns
    got = scrape(registry)
    s, types = got["samples"], got["types"]
    # API.md: every series is named <namespace>_<metric>, counters included (no _total suffix)
    assert types["feeder_batches"] == "gauge" and types["feeder_queue_size"] == "gauge"
    assert not any(name.endswith("_total") for name in s), sorted(s)
    assert s["feeder_batches"] == {"train": 5.0, "test": 2.0}
    assert s["feeder_rows"] == {"train": 20.0, "test": 8.0}
    assert s["feeder_bytes_delivered"]["train"] == 5 * 4 * 2 * 4
    assert s["feeder_batch_size"] == {"train": 4.0, "test": 4.0}
    assert s["feeder_fetch_calls"]["train"] >= 2
    assert s["feeder_source_rows_delivered"] == {"train": 20.0, "test": 8.0}


def test_replicas_add_up_into_their_source_and_loggers_share_a_registry(coord):
    registry = prometheus_client.CollectorRegistry()
    a, b = feeder.PrometheusLogger(registry=registry), feeder.PrometheusLogger(registry=registry)
    other = feeder.PrometheusLogger(registry=registry, namespace="job")
    for logger in (a, b):  # two replicas of one source, each with its own logger
        feeder.init_data_input_workers(None, ["x"], chunk, 3, num_worker_threads=1, input_source_name="score",
                                       external_loggers=[logger, other], coordinator=coord)
    coord.start()
    feeds = coord.feeds("score")
    for _ in range(3):
        feeds[0].next_batch(timeout=10)
    feeds[1].next_batch(timeout=10)
    assert coord.stop()
    s = scrape(registry)["samples"]
    assert s["feeder_batches"] == {"score": 4.0}  # 3 + 1: the replicas add up
    assert s["feeder_source_rows_delivered"] == {"score": 12.0}  # the source's own: not doubled
    assert s["feeder_batch_size"] == {"score": 3.0}
    assert s["job_batches"] == s["feeder_batches"]


def test_plain_loggers_still_get_log_metrics_only(coord):
    class Plain:
        def __init__(self):
            self.calls = []

        def log(self, metrics):  # no feed= parameter: must not be passed one
            self.calls.append(metrics)

    plain = Plain()
    feeder.init_data_input_workers(None, ["x"], chunk, 4, num_worker_threads=1, external_loggers=[plain],
                                   coordinator=coord)
    coord.start()
    coord.feed("train").next_batch(timeout=10)
    assert coord.stop()
    assert plain.calls and plain.calls[-1]["batches"] == 1.0


def test_bad_namespace_is_rejected():
    registry = prometheus_client.CollectorRegistry()
    with pytest.raises(ValueError, match="namespace"):
        feeder.PrometheusLogger(registry=registry, namespace="bad name")


def test_importing_feeder_does_not_import_prometheus_client():
    code = ("import sys, feeder; assert 'prometheus_client' not in sys.modules, 'imported'; "
            "print(feeder.PrometheusLogger.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PrometheusLogger"


def test_without_prometheus_client_creating_a_logger_says_what_to_install():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import feeder\n"
            "try:\n    feeder.PrometheusLogger()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'feeder[prometheus]'" in out.stdout


def test_counters_survive_a_gone_feed_and_hand_calls_name_their_source():
    import gc

    from feeder.prometheus import _Collector

    class FakeFeed:
        def __init__(self, name):
            self.input_source_name = name

    collector = _Collector("feeder")
    first, second = FakeFeed("train"), FakeFeed("train")
    collector.update("train", first, {"batches": 1.0, "ready_batches": 2.0})
    collector.update("train", second, {"batches": 2.0, "ready_batches": 1.0})
    assert collector.values()["train"] == {"batches": 3.0, "ready_batches": 3.0}
    del first
    gc.collect()
    collector.update("train", FakeFeed("train"), {"batches": 3.0, "ready_batches": 0.0})
    # the gone feed's count stays in the total; gauges count the feeds still there
    assert collector.values()["train"]["batches"] == 6.0

    registry = prometheus_client.CollectorRegistry()
    prom = feeder.PrometheusLogger(registry=registry, namespace="app")
    prom.log({"rows": 5.0, "queue_size": 1.0}, source="manual")
    assert registry.get_sample_value("app_rows", {"source": "manual"}) == 5.0
    assert registry.get_sample_value("app_queue_size", {"source": "manual"}) == 1.0
