"""Where the time goes: a verdict on what bounds a feed's throughput, from its stage times.

Pure logic, no threads: :class:`StageTimes` holds what a feed measured (the consumer's time
waiting for batches, in ``run()`` and in its own code between calls; the fetchers' time in
``fetch_fun``, blocked on a full queue, and their CPU use), and :func:`verdict` turns it into
a few plain sentences: which stage bounds throughput, by how much, what to change, and the
figures behind it.

How it decides (shares of the consumer's time, which is what the runtime sees):

* input-bound: the consumer waited for batches at least a quarter of its time, and longer
  than it spent in ``run()`` or in its own code. Then the fetchers say why: busy in
  ``fetch_fun`` but using little CPU (I/O, sleeps): more threads; using about one core in all
  with several threads (Python holding the GIL): worker processes; blocked on a full queue
  while the consumer still waits: the queue absorbs no bursts (a larger
  ``max_buffered_batches``) or the enqueuer is the bottleneck; CPU-bound fetchers next to an
  ONNX Runtime session with several intra-op threads: fewer intra-op threads (spinning pool
  threads take the fetchers' core).
  Before the fetchers, the stages between them and the runtime: writing batches on the host
  (``assemble_s``, by up to ``assemble_threads`` threads at once) and, on a device, copying them
  there (``copy_s``, one stream): the most used of fetch, assemble and copy is named, with its
  share; a copy- or assemble-bound feed is never advised more fetchers.
* model-bound: ``run()`` takes the largest share; feeding keeps up.
* consumer-bound: the consumer's own code between calls takes the largest share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

INPUT_BOUND_SHARE = 0.25   # the consumer waiting this share of its time is input-bound
BLOCKED_SHARE = 0.2        # fetchers blocked on a full queue this share of their time: queue full
GIL_CORES = 1.3            # threads using at most this many cores in all (with >= 2 busy): GIL-bound
CPU_BOUND = 0.6            # a fetcher using this share of a core while busy is CPU-bound
COPY_BOUND = 0.6           # the device's copies busy this share of the time (one stream): copy-bound
COPY_MOST = 0.25           # ... and below that, named as the most used stage from this share on
ASSEMBLE_BOUND = 0.5       # the assembling threads busy this share of their capacity: assemble-bound


@dataclass
class StageTimes:
    """A feed's stage times; all times are seconds, summed over threads where there are several."""

    elapsed_s: float               # since the feed started
    batches: float
    rows: float
    consumer_wait_s: float         # consumers waiting for a batch
    consumer_run_s: float          # consumers inside run() (the session)
    consumer_between_s: float      # consumers' own code between two calls
    workers: int                   # fetchers (threads or processes) that ran (not parked all along)
    mode: str                      # "threads" or "processes"
    fetch_s: float                 # fetchers inside fetch_fun
    fetch_blocked_s: float         # fetchers waiting for room in the source
    fetch_wall_s: float            # fetchers' running times (lifetimes less time parked), summed
    fetch_cpu_s: float             # fetchers' CPU time (sampled), ...
    fetch_cpu_wall_s: float        # ... over this much of their running times
    rows_fetched: float
    queue_capacity: float          # chunks
    intra_op_threads: Optional[int] = None  # the session's intra-op threads; 0: ORT's default (all cores)
    fetch_longest_s: float = 0.0   # the longest running time of one fetcher; 0: all ran all along
    auto: bool = False             # num_worker_threads="auto" chose how many ran
    transform_s: float = 0.0       # of fetch_s, inside a source's map and filter functions
    rows_filtered: float = 0.0     # rows those filters dropped
    assemble_s: float = 0.0        # threads writing batches on the host (copying rows out of chunks), summed
    assemble_threads: int = 1      # how many may write big batches at once
    copy_s: float = 0.0            # the device copying batches (timed on the device; one stream)
    device: bool = False           # batches go to a device (device slots, a stream)


def running_at_once(t: StageTimes) -> float:
    """How many fetchers ran at a time, on average: their running times over the longest one's
    (``workers`` when all ran all along; less when "auto" parked some, or some ended early)."""
    if t.fetch_longest_s > 0:
        return min(float(t.workers), t.fetch_wall_s / t.fetch_longest_s)
    return float(t.workers)


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "0%"


def verdict(t: StageTimes) -> str:
    """A few sentences: what bounds throughput, by how much, what to change, and the figures."""
    consumer = t.consumer_wait_s + t.consumer_run_s + t.consumer_between_s
    rate = t.rows / t.elapsed_s if t.elapsed_s > 0 else 0.0
    busy = t.fetch_s / t.fetch_wall_s if t.fetch_wall_s > 0 else 0.0           # per fetcher, in fetch_fun
    blocked = t.fetch_blocked_s / t.fetch_wall_s if t.fetch_wall_s > 0 else 0.0
    # Shares of a core while running, times how many ran at once: a fetcher parked by "auto"
    # neither adds a core nor dilutes the share of those that ran.
    per_fetcher_cpu = t.fetch_cpu_s / t.fetch_cpu_wall_s if t.fetch_cpu_wall_s > 0 else 0.0
    running = running_at_once(t)
    cores = per_fetcher_cpu * running  # in all
    fetched = t.rows_fetched / t.elapsed_s if t.elapsed_s > 0 else 0.0
    out: List[str] = []

    if t.batches == 0 or consumer <= 0:
        out.append("No batch has been consumed yet, so there is no verdict.")
    else:
        wait, run, between = (x / consumer for x in (t.consumer_wait_s, t.consumer_run_s, t.consumer_between_s))
        stage = _feeding_bound(t, busy * running)
        if wait >= INPUT_BOUND_SHARE and wait >= run and wait >= between and stage is not None:
            out.append(stage)
        elif wait >= INPUT_BOUND_SHARE and wait >= run and wait >= between:
            out.append(f"Input-bound: the consumer waited for batches {_pct(wait, 1)} of its time "
                       f"({t.consumer_wait_s:.2f} s of {consumer:.2f} s); the runtime idles while data is prepared.")
            out += _input_advice(t, busy, blocked, cores, per_fetcher_cpu)
        elif run >= between:
            out.append(f"Model-bound: run() takes {_pct(run, 1)} of the consumer's time and it waited for "
                       f"batches only {_pct(wait, 1)}; feeding keeps up"
                       + (f" (fetchers were blocked on a full queue {_pct(blocked, 1)} of their time)."
                          if t.fetch_wall_s > 0 else "."))
            out.append("To go faster, speed up the model or run replicas (several feeds of one source, "
                       "one consumer thread and IOBinding each); more fetchers would not help.")
        else:
            out.append(f"Consumer-bound: your code between calls takes {_pct(between, 1)} of the consumer's "
                       f"time, run() {_pct(run, 1)} and waiting for batches {_pct(wait, 1)}; feeding keeps up.")
            out.append("To go faster, move work out of the loop between calls (into fetch_fun, or after "
                       "the run), or consume from several threads.")

    figures = (f"Figures: {t.batches:.0f} batches, {t.rows:.0f} rows in {t.elapsed_s:.1f} s ({rate:,.0f} rows/s); "
               f"consumer: waiting {t.consumer_wait_s:.2f} s, in run() {t.consumer_run_s:.2f} s, "
               f"between calls {t.consumer_between_s:.2f} s")
    if t.workers:
        at_once = ""
        if t.auto or running < t.workers - 0.25:
            at_once = f" ({running:.1f} running at a time on average{', auto' if t.auto else ''})"
        steps = ""
        if t.transform_s > 0:
            reading = max(0.0, t.fetch_s - t.transform_s)
            steps = (f" (reading {reading:.2f} s, map/filter functions {t.transform_s:.2f} s"
                     + (f", {t.rows_filtered:,.0f} rows filtered" if t.rows_filtered else "") + ")")
        mode = t.mode if t.workers != 1 else {"threads": "thread", "processes": "process"}.get(t.mode, t.mode)
        figures += (f"; {t.workers} fetcher {mode}{at_once}: in fetch_fun {_pct(busy, 1)} of their time{steps}, "
                    f"blocked on a full queue {_pct(blocked, 1)}, {cores:.2f} CPU cores in all, fetching "
                    f"{fetched:,.0f} rows/s")
    if t.assemble_s > 0 or t.device:
        figures += f"; writing batches {t.assemble_s:.2f} s (up to {t.assemble_threads} threads at once)"
    if t.device:
        figures += f"; copying them to the device {t.copy_s:.2f} s"
    out.append(figures + f"; queue of {t.queue_capacity:.0f} chunks.")
    return " ".join(out)


def _feeding_bound(t: StageTimes, fetching: float) -> Optional[str]:
    """When the consumer waits: the verdict of a feed bound between its fetchers and the runtime, by
    writing batches (assemble) or copying them to the device (copy), with what to change; None when
    the fetchers are the more used (their advice follows). ``fetching``: fetchers in fetch_fun at a
    time, on average."""
    if t.elapsed_s <= 0:
        return None
    workers = max(1.0, running_at_once(t)) if t.workers else 1.0
    fetch_use = fetching / workers
    copy_use = t.copy_s / t.elapsed_s
    assemble_use = t.assemble_s / t.elapsed_s / max(1, t.assemble_threads)
    if copy_use >= COPY_BOUND and copy_use >= fetch_use and copy_use >= assemble_use:
        return (f"Copy-bound: copying batches to the device keeps it busy {_pct(copy_use, 1)} of the time "
                f"({t.copy_s:.2f} s of {t.elapsed_s:.2f} s) while the consumer waits for them; the fetchers are in "
                f"fetch_fun {_pct(fetch_use, 1)} of their time, so more fetchers would not help. To go faster, copy "
                f"fewer bytes (uint8 inputs cast on the device by the model rather than float32), and make sure "
                f"batches come from pinned or registered memory (worker processes' chunks go to the device straight "
                f"from their shared memory; the log says when pinned memory could not be had).")
    blocked = t.fetch_blocked_s / t.fetch_wall_s if t.fetch_wall_s > 0 else 0.0
    if t.device and copy_use >= COPY_MOST and copy_use >= fetch_use and copy_use >= assemble_use \
            and blocked < BLOCKED_SHARE:
        # No stage is saturated, but the copy is the most used: the fetchers' advice ("more
        # threads help", for fetchers that mostly wait) would send the user the wrong way.
        consumer = t.consumer_wait_s + t.consumer_run_s + t.consumer_between_s
        return (f"Input-bound: the consumer waited for batches {_pct(t.consumer_wait_s, consumer)} of its time; of "
                f"the stages that feed it, copying batches to the device is the most used ({_pct(copy_use, 1)} of "
                f"the time), ahead of the fetchers in fetch_fun ({_pct(fetch_use, 1)} of theirs), so more fetchers "
                f"would not help. To go faster, copy fewer bytes (uint8 inputs cast on the device by the model "
                f"rather than float32), and make sure batches come from pinned or registered memory.")
    if assemble_use >= ASSEMBLE_BOUND and assemble_use >= fetch_use:
        return (f"Assemble-bound: writing batches (copying rows out of their chunks) keeps the "
                f"{t.assemble_threads} assembling thread(s) busy {_pct(assemble_use, 1)} of the time "
                f"({t.assemble_s:.2f} s in {t.elapsed_s:.2f} s) while the consumer waits; the fetchers are in "
                f"fetch_fun {_pct(fetch_use, 1)} of their time, so more fetchers would not help. To go faster, "
                f"raise assemble_threads (now {t.assemble_threads}) if cores are free, return chunks of whole "
                f"batches (handed on without a copy), or use worker processes (their small chunks are joined in "
                f"the worker).")
    return None


def _input_advice(t: StageTimes, busy: float, blocked: float, cores: float, per_fetcher_cpu: float) -> List[str]:
    if t.workers == 0:
        return ["No fetcher ran."]
    advice = []
    if blocked >= BLOCKED_SHARE:
        advice.append(f"Yet the fetchers were blocked on a full queue {_pct(blocked, 1)} of their time: the "
                      f"queue does not absorb bursts, so raise max_buffered_batches (now {t.queue_capacity:.0f} "
                      f"chunks), or the rebatching thread is the bottleneck (fewer, larger chunks help).")
    elif t.mode == "threads" and t.workers >= 2 and cores >= CPU_BOUND and cores <= GIL_CORES and busy >= 0.5:
        advice.append(f"The {t.workers} fetcher threads used {cores:.2f} CPU cores in all: Python fetch code holds "
                      f"the GIL, so threads take turns. Use worker processes (num_worker_processes="
                      f"{max(2, t.workers)}), or make fetch_fun spend its time in numpy or I/O.")
    elif per_fetcher_cpu >= CPU_BOUND:
        what = "worker processes" if t.mode == "processes" else "fetchers (processes if fetch_fun is Python code)"
        advice.append(f"The fetchers are CPU-bound ({per_fetcher_cpu:.0%} of a core each while running): add "
                      f"{what} up to the free cores, or make fetch_fun cheaper.")
    elif t.mode == "processes" and busy < 0.5:
        advice.append(f"The worker processes spent only {_pct(busy, 1)} of their time in fetch_fun and used "
                      f"{per_fetcher_cpu:.0%} of a core each: they mostly waited for the parent to take their "
                      f"chunks, so the parent's side (rebatching, many small chunks, the consumer's own code) bounds "
                      f"throughput; chunks of at least a batch help, more processes do not.")
    elif t.mode == "processes":
        advice.append(f"The worker processes spent {_pct(busy, 1)} of their time in fetch_fun but used only "
                      f"{per_fetcher_cpu:.0%} of a core each: they wait on I/O or sleeps, so more of them help, "
                      f"or threads, which cost less for waiting (num_worker_threads={2 * t.workers}).")
    else:
        advice.append(f"The fetchers spent {_pct(busy, 1)} of their time in fetch_fun but used only "
                      f"{per_fetcher_cpu:.0%} of a core each: they wait on I/O or sleeps, so more worker threads "
                      f"help (num_worker_threads={2 * t.workers}).")
    if t.transform_s > 0 and t.transform_s >= 0.5 * t.fetch_s and busy >= 0.5:
        advice.append(f"Of the time in fetch_fun, the source's map and filter functions took "
                      f"{_pct(t.transform_s, t.fetch_s)} ({t.transform_s:.2f} s), reading the rest: make those "
                      f"functions cheaper (vectorised numpy), or run them in more "
                      f"{'worker processes' if t.mode == 'processes' else 'worker processes (num_worker_processes)'}.")
    if cores >= CPU_BOUND and t.intra_op_threads is not None and t.intra_op_threads != 1:
        advice.append("The session runs several intra-op threads, whose spinning takes the CPU the fetchers "
                      "need: create it with intra_op_num_threads=1 (or session.intra_op.allow_spinning=0) "
                      "and scale with replicas.")
    return advice
