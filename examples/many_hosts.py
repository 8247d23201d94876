"""Many hosts without Ray: ranks launched the torchrun way, one killed, merged, resumed elsewhere.

A launcher starts WORLD rank processes with ``RANK`` and ``WORLD_SIZE`` in their environment (as
torchrun, Slurm or mpirun would; here plain subprocesses, so no torch is needed). Each rank builds
the same ``ParquetSource(..., shuffle=True, shard="env", equal_steps=True)``: it reads its own
part of every epoch, disjoint from the others', without talking to them, and every rank gets the
same number of batches (what a collective training step needs). Each rank runs a small ONNX model
on its batches and checkpoints ``coord.state_dict(...)`` with its step every few steps.

The launcher kills one rank with SIGKILL in the middle of the epoch (as a lost node would be),
lets the others finish, merges every rank's last checkpoint with ``feeder.sources.merge_states``, and
resumes on a different number of ranks. At the end it checks, from the rows each rank logged up to
its checkpoints, that every row was scored exactly once (the rows ``equal_steps`` leaves out of an
epoch, fewer than the world size, aside).

Run:  python examples/many_hosts.py [--rows 200000] [--world 3] [--resume-world 2]
      (a rank alone: RANK=0 WORLD_SIZE=3 python examples/many_hosts.py --rank-of DIR)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np

import feeder
from feeder.sources import ParquetSource, merge_states

BATCH, DIM, EVERY = 256, 16, 10  # rows per batch, features per row, steps between checkpoints


def build_model() -> bytes:
    """x float32 [N, 16] -> score float32 [N, 1]: one linear layer."""
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.linspace(-1, 1, DIM, dtype=np.float32).reshape(DIM, 1), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["score"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIM])],
                              [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["N", 1])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnxruntime 1.31 accepts IR <= 13
    return model.SerializeToString()


def write_data(folder: str, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for f, lo in enumerate(range(0, rows, rows // 4)):
        ids = np.arange(lo, min(rows, lo + rows // 4))
        x = rng.standard_normal((len(ids), DIM), dtype=np.float32)
        pq.write_table(pa.table({"id": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM)}),
                       os.path.join(folder, f"part-{f}.parquet"), row_group_size=8192)


def rank_main(work: str) -> None:
    """One rank: RANK and WORLD_SIZE come from the environment, as a launcher sets them."""
    import onnxruntime as ort
    rank = int(os.environ["RANK"])
    resume_path = os.path.join(work, "resume.json")
    resume = json.load(open(resume_path)) if os.path.exists(resume_path) else None
    source = ParquetSource(os.path.join(work, "data"), {"x": "x", "id": "id"}, shuffle=True, seed=7,
                           shard="env", equal_steps=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(build_model(), opts, providers=["CPUExecutionProvider"])
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "id"], source, BATCH, num_worker_threads=2, coordinator=coord,
                                   input_source_name="score", resume_from=resume)
    run = os.environ.get("RUN", "first")
    log = open(os.path.join(work, f"rows-{run}-{rank}.log"), "a")
    logged = 0

    def checkpoint() -> None:
        log.flush()
        tmp = os.path.join(work, f"ckpt-{run}-{rank}.tmp")
        with open(tmp, "w") as f:
            json.dump({"state": coord.state_dict("score"), "logged": logged}, f)
        os.replace(tmp, os.path.join(work, f"ckpt-{run}-{rank}.json"))

    with coord:
        for step, batch in enumerate(coord.feed("score"), 1):
            session.run(None, {"x": batch["x"]})           # the model's step on this rank's batch
            log.write("".join(f"{i}\n" for i in batch["id"].tolist()))
            logged += len(batch["id"])
            if step % EVERY == 0:
                checkpoint()
            time.sleep(0.002)                              # a step takes a while, as training would
        checkpoint()
    print(f"rank {rank}: {logged} rows in {step} steps", flush=True)


def launch(work: str, world: int, run: str, kill: bool) -> None:
    """Start ``world`` ranks (RANK / WORLD_SIZE in their environment, and LOCAL_RANK as torchrun sets it:
    it tells shard="env" that these ranks were started inside whatever job runs this); with ``kill``, SIGKILL rank 1
    once it has checkpointed a few times (a lost node) and let the others finish their share."""
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank-of", work],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), RUN=run))
             for r in range(world)]
    if kill:
        ckpt = os.path.join(work, f"ckpt-{run}-1.json")
        while not (os.path.exists(ckpt) and json.load(open(ckpt))["logged"] >= 3 * EVERY * BATCH):
            if any(p.poll() is not None for p in ranks):
                break
            time.sleep(0.01)
        ranks[1].send_signal(signal.SIGKILL)
        print("killed rank 1 mid-epoch (SIGKILL); the other ranks finish their share")
    for p in ranks:
        p.wait()


def scored(work: str, run: str, world: int) -> list:
    """Rows the ranks' last checkpoints cover."""
    rows = []
    for r in range(world):
        ckpt = json.load(open(os.path.join(work, f"ckpt-{run}-{r}.json")))
        with open(os.path.join(work, f"rows-{run}-{r}.log")) as f:
            rows += [int(line) for _, line in zip(range(ckpt["logged"]), f)]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--resume-world", type=int, default=2)
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of)
    with tempfile.TemporaryDirectory() as work:
        write_data(os.path.join(work, "data"), args.rows)
        launch(work, args.world, "first", kill=True)
        states = [json.load(open(os.path.join(work, f"ckpt-first-{r}.json")))["state"] for r in range(args.world)]
        merged = merge_states(states)
        with open(os.path.join(work, "resume.json"), "w") as f:
            json.dump(merged, f)
        print(f"merged the {args.world} ranks' states: {merged['rows_delivered']} rows delivered; resuming on "
              f"{args.resume_world} ranks")
        launch(work, args.resume_world, "second", kill=False)
        counts = Counter(scored(work, "first", args.world) + scored(work, "second", args.resume_world))
        twice = sum(1 for c in counts.values() if c > 1)
        missing = args.rows - len(counts)
        print(f"{len(counts)} of {args.rows} rows scored, {twice} twice, {missing} left out by equal_steps "
              f"(fewer than the world size per epoch)")
        if twice or missing >= args.resume_world:
            sys.exit("rows were lost or scored twice")


if __name__ == "__main__":
    main()
