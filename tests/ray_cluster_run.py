"""RayDataSource on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``), one scenario per run.

Run by tests/test_ray.py in a subprocess, so that this cluster does not meet the test session's
local Ray instance (one Ray connection per process). Prints one JSON line per scenario, prefixed ``RESULT``.

Scenarios (argv, default all three in this order, on one cluster):

* ``placement``: a ``map_batches`` step that needs the custom resource ``pre``, which only the
  second node has, feeds 2 replicas; every row must arrive exactly once, preprocessed there.
* ``node_loss``: the same pipeline, slowed down; the second node is removed mid-stream. Ray
  cannot run the remaining tasks anywhere else, so the source must fail with FetchError (the
  stall timeout) rather than hang, or, if Ray recovers, deliver every row once.
* ``node_loss_retry``: the step prefers the second node but may run anywhere (a soft node
  affinity); the node is removed mid-stream and Ray retries its tasks on the head: every row once.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import numpy as np

ROWS = 4000
BLOCKS = 24


STALL_S = 6.0  # the source's stall_timeout after a node loss: how long a shard may wait on Ray before FetchError
FIRST_STALL_S = 30.0  # where no stall is expected: a loaded machine can take seconds to start a task


def warm(worker) -> None:
    """Start a Python worker process on each node (seconds each on a loaded machine), so that a
    scenario's stall timeout measures Ray's progress, not process start-up."""
    import ray

    @ray.remote(num_cpus=1)
    def ready() -> str:
        import numpy  # noqa: F401 - what the pipeline's tasks import
        return ray.get_runtime_context().get_node_id()

    nodes = ray.get([ready.options(resources={"pre": 0.01}).remote(), ready.remote()], timeout=120)
    assert worker.node_id in nodes, nodes


def start_cluster() -> tuple:
    import ray
    import ray.cluster_utils

    # Dead nodes are noticed after 3 missed health checks of 0.5 s (default 5 of 3 s), so a retry
    # on another node starts within seconds.
    system = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
    cluster = ray.cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": system})
    worker = cluster.add_node(num_cpus=1, resources={"pre": 1})
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    cluster.wait_for_nodes()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    return cluster, worker


def run(scenario: str, cluster, worker) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import feeder
    from feeder.sources import RayDataSource

    worker_id = worker.node_id
    delay = 0.0 if scenario == "placement" else 0.1

    def preprocess(batch: dict) -> dict:
        import ray as _ray
        time.sleep(delay)
        ids = batch["id"]
        on_worker = _ray.get_runtime_context().get_node_id() == worker_id
        return {"x": (ids[:, None] * np.ones(4)).astype(np.float32), "id": ids,
                "on_worker": np.full(len(ids), on_worker)}

    if scenario == "node_loss_retry":
        remote_args = {"scheduling_strategy": NodeAffinitySchedulingStrategy(worker_id, soft=True)}
    else:
        remote_args = {"resources": {"pre": 0.25}}
    ds = ray.data.range(ROWS, override_num_blocks=BLOCKS).map_batches(preprocess, **remote_args)
    stall = STALL_S if scenario == "node_loss" else FIRST_STALL_S
    source = RayDataSource(ds, columns={"x": "x", "k": "id", "w": "on_worker"}, stall_timeout=stall)

    coord = feeder.GlobalCoordinator(join_timeout=5.0)
    for _ in range(2):
        feeder.init_data_input_workers(None, ["x", "k", "w"], source, batch_size=50, num_worker_threads=2,
                                       input_source_name="ray", coordinator=coord, timeout=60.0)
    got: list = [[], []]
    errors: list = [None, None]
    removed_at: list = [None]
    some_rows = threading.Event()

    def consume(i: int) -> None:
        feed = coord.feeds("ray")[i]
        try:
            for batch in feed:
                got[i].append((batch["k"].copy(), batch["w"].copy()))
                if sum(len(k) for r in got for k, _ in r) >= ROWS // 5:
                    some_rows.set()
        except Exception as e:  # recorded for the report: FetchError is an allowed outcome of a node loss
            errors[i] = e
        finally:
            some_rows.set()

    t1 = time.monotonic()
    coord.start()
    threads = [threading.Thread(target=consume, args=(i,), name=f"consumer-{i}") for i in range(2)]
    for t in threads:
        t.start()
    if scenario.startswith("node_loss"):
        some_rows.wait(60.0)
        cluster.remove_node(worker, allow_graceful=False)
        removed_at[0] = time.monotonic() - t1
    for t in threads:
        t.join(90.0)
    hung = any(t.is_alive() for t in threads)
    elapsed = time.monotonic() - t1
    stopped = coord.stop()
    keys = np.concatenate([k for r in got for k, _ in r]) if any(got) else np.zeros(0, np.int64)
    on_worker = np.concatenate([w for r in got for _, w in r]) if any(got) else np.zeros(0, bool)
    err = next((e for e in errors if e is not None), None)
    left = [t.name for t in threading.enumerate() if t.name.startswith("feeder:")]
    return {
        "scenario": scenario, "elapsed_s": round(elapsed, 2),
        "removed_at_s": None if removed_at[0] is None else round(removed_at[0], 2),
        "rows": int(len(keys)), "unique": int(len(np.unique(keys))), "expected": ROWS,
        "exact": bool(len(keys) == ROWS and np.array_equal(np.sort(keys), np.arange(ROWS))),
        "duplicates": int(len(keys) - len(np.unique(keys))),
        "rows_per_replica": [int(sum(len(k) for k, _ in r)) for r in got],
        "all_on_worker": bool(on_worker.all()) if len(on_worker) else None,
        "error": None if err is None else type(err).__name__,
        "cause": None if err is None or err.__cause__ is None else type(err.__cause__).__name__,
        "message": None if err is None else str(err)[:300],
        "hung": hung, "stopped_cleanly": stopped, "feeder_threads_left": left,
    }


def main(scenarios: list) -> None:
    """Each scenario in turn on one cluster; a node removed by one is replaced for the next."""
    import ray

    t0 = time.monotonic()
    cluster, worker = start_cluster()
    print("STARTUP " + json.dumps({"startup_s": round(time.monotonic() - t0, 2)}), flush=True)
    for i, scenario in enumerate(scenarios):
        if i and scenarios[i - 1].startswith("node_loss"):
            worker = cluster.add_node(num_cpus=1, resources={"pre": 1})
            cluster.wait_for_nodes()
        warm(worker)
        print("RESULT " + json.dumps(run(scenario, cluster, worker)), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:] or ["placement", "node_loss_retry", "node_loss"])
    sys.stdout.flush()
    os._exit(0)  # Ray's atexit hooks can take seconds more; everything is shut down already
