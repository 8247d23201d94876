"""PrometheusLogger: series names, labels and values, scraped from a real exporter on 127.0.0.1."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from utils import ListLogger, wait_until

import feeder
from feeder.feedstats import METRIC_KEYS, REPORT_KEYS, TOTALS

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def chunk(worker_id, batch_size):
    return [np.ones((3, 2), np.float32)]


def scrape(registry) -> dict:
    """Serve ``registry`` on an ephemeral port of 127.0.0.1, scrape it once, shut the server down.
    Returns {sample name: {source: value}} and the family types; every sample's labels must be
    exactly {"source": ...}, as the contract says."""
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
    # The contract: every series is named <namespace>_<metric>, counters included (no _total suffix)
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
    assert "pip install 'onnx-feeder[prometheus]'" in out.stdout


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


def totals(registry, source):
    return {k: registry.get_sample_value(f"feeder_{k}", {"source": source}) for k in sorted(TOTALS)}


def test_totals_never_go_back_after_a_stop_and_a_new_registration(coord):
    """The source's ledger starts from 0 with each registration after a stop: published as it
    was, feeder_source_rows_fetched went 1696 -> 272. Earlier generations stay in the totals."""
    registry = prometheus_client.CollectorRegistry()
    prom = feeder.PrometheusLogger(registry=registry)
    seen = []
    for n in (6, 2):
        feeder.init_data_input_workers(None, ["x"], chunk, 4, num_worker_threads=1, external_loggers=[prom],
                                       coordinator=coord)
        coord.start()
        for _ in range(n):
            coord.feed("train").next_batch(timeout=10)
        assert coord.stop()
        seen.append(totals(registry, "train"))
    before, after = seen
    assert all(after[k] >= before[k] for k in before), [(k, before[k], after[k]) for k in before
                                                          if after[k] < before[k]]
    assert after["source_rows_delivered"] == 8 * 4 and after["batches"] == 8
    assert after["source_rows_fetched"] > before["source_rows_fetched"]


def test_totals_keep_what_stopped_replicas_contributed(coord):
    """Stage times were summed over the feeds still running: when the replicas stopped, only the
    last one's were left, and feeder_fetch_wall_s, feeder_consumer_between_s ... went back."""
    registry = prometheus_client.CollectorRegistry()
    prom = feeder.PrometheusLogger(registry=registry)
    for _ in range(2):
        feeder.init_data_input_workers(None, ["x"], chunk, 3, num_worker_threads=1, input_source_name="score",
                                       external_loggers=[prom], log_interval=0.05, coordinator=coord)
    coord.start()
    for feed in coord.feeds("score"):
        for _ in range(3):
            feed.next_batch(timeout=10)
    wait_until(lambda: registry.get_sample_value("feeder_batches", {"source": "score"}) == 6.0,
               what="both replicas' reports")
    live = totals(registry, "score")
    assert coord.stop()
    stopped = totals(registry, "score")
    assert all(stopped[k] >= live[k] for k in live), [(k, live[k], stopped[k]) for k in live
                                                      if stopped[k] < live[k]]
    assert stopped["fetch_wall_s"] > 0 and stopped["consumer_between_s"] > 0


def test_every_key_a_feed_reports_is_declared(coord):
    """describe() lists the families from feeder.feedstats: the feeds' keys must all be there."""
    logger = ListLogger()
    feeder.init_data_input_workers(None, ["x"], chunk, 4, num_worker_threads=1, external_loggers=[logger],
                                   coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    feed.next_batch(timeout=10)
    assert set(feed.metrics()) == set(METRIC_KEYS)
    assert coord.stop()
    assert set(logger.records[-1]) == set(REPORT_KEYS) and TOTALS <= set(METRIC_KEYS)


def test_a_name_clash_in_the_registry_fails_when_the_logger_is_created():
    """describe() returned nothing, so a clash went unnoticed and the exposition held two
    families of one name. The registry refuses it now with its usual ValueError."""
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("feeder_batches", "the user's own", registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        feeder.PrometheusLogger(registry=registry)

    registry = prometheus_client.CollectorRegistry()
    first = feeder.PrometheusLogger(registry=registry)
    assert feeder.PrometheusLogger(registry=registry)._collector is first._collector  # one per namespace, shared
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        feeder.PrometheusLogger(registry=registry, namespace="feeder_source")  # feeder_source_rows_fetched
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        prometheus_client.Gauge("feeder_rows", "the user's own, after the logger", registry=registry)
    feeder.PrometheusLogger(registry=registry, namespace="job")  # no overlap: fine
    first.log({"rows": 1.0}, source="a")
    families = [f.name for f in text_string_to_metric_families(prometheus_client.generate_latest(registry).decode())]
    assert len(families) == len(set(families))
