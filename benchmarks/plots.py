"""Draw the plots of the performance pages from the committed results files.

    python benchmarks/plots.py            # (re)write docs/images/perf-*.svg from benchmarks/results/
    python benchmarks/plots.py --check    # exit 1 if a committed plot differs from what this draws

Each plot is made only from files under ``benchmarks/results/`` (never from a live run), so a
plot and the table beside it on docs/performance.md come from the same figures; ``--check``
(run by tests/test_docs.py and .ci/run) fails when a plot was not redrawn after its results
changed, or was edited by hand. The SVGs are byte-for-byte reproducible with the matplotlib
pinned in the ``docs`` extra: no date in them, fixed ids (``svg.hashsalt``), and text drawn as
paths from the DejaVu Sans that matplotlib ships (not a system font), so that they look the same
in every browser and do not depend on the fonts a machine has.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"

# The scenarios of benchmarks/compare.py by the names the docs use.
NAMES = {
    "a": "tiny chunks, no model", "b": "large rows, no model", "c": "fetch-bound (5 ms a fetch)",
    "d": "model-bound", "m": "model-bound, cheap fetch", "d-spin": "model-bound, ORT defaults",
    "p": "Python fetch + model", "s-tiny": "tiny chunks", "s-large": "large rows (3 MB chunks)",
    "s-io": "I/O-bound fetch + model", "s-cpu": "Python fetch + model",
}
BLUE, ORANGE, GREEN, GREY, PURPLE = "#3f51b5", "#ef6c00", "#2e7d32", "#9e9e9e", "#8e24aa"


def load(name: str) -> Dict:
    with open(RESULTS / name, encoding="utf-8") as f:
        return json.load(f)


def _pyplot():
    import matplotlib
    from matplotlib import font_manager

    matplotlib.use("svg")
    # matplotlib's own copy of the font, by path: a system font of the same name may differ.
    path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf")
    if not any(f.name == "feeder-plots" for f in font_manager.fontManager.ttflist):
        font_manager.fontManager.ttflist.append(font_manager.FontEntry(fname=path, name="feeder-plots"))
    matplotlib.rcParams.update({
        "svg.hashsalt": "feeder-plots",  # fixed element ids: the same bytes on every run
        "svg.fonttype": "path",          # glyphs as paths: the same drawing in every browser
        "font.family": "feeder-plots", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
    })
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, labels: Sequence[str], series: List[Tuple[str, str, Sequence[float]]], xlabel: str) -> None:
    """Horizontal grouped bars: one group per label, one bar per series, a line at 1.0."""
    n = len(series)
    height = 0.8 / n
    for i, (name, color, values) in enumerate(series):
        ys = [g + (i - (n - 1) / 2) * height for g in range(len(labels))]
        xs = [v if v == v else 0.0 for v in values]  # NaN: no bar
        ax.barh(ys, xs, height=height * 0.92, color=color, label=name)
        for y, v in zip(ys, values):
            if v == v:
                ax.text(v, y, f" {v:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)


def alternatives(plt) -> object:
    """docs/performance.md, "Against the alternatives": rows/s relative to the serial loop."""
    data = load("compare.json")
    order = ["a", "b", "c", "d", "m", "d-spin", "p"]
    res = data["results"]
    nan = float("nan")

    def rel(s: str, peer: str) -> float:
        rows = res[s]["rows_per_s"]
        return rows[peer] / rows["serial"] if peer in rows else nan

    fig, ax = plt.subplots(figsize=(7.2, 5.0))
    _bars(ax, [NAMES[s] for s in order], [
        ("feeder, 2 threads", BLUE, [rel(s, "feeder") for s in order]),
        ("feeder, 2 worker processes", ORANGE, [rel(s, "feeder procs") for s in order]),
        ("Caffe2's data_workers design", GREY, [rel(s, "seed") for s in order]),
        ("the model alone (a bound)", GREEN, [rel(s, "model alone") for s in order]),
    ], "rows/s relative to the serial loop (fetch, concatenate, run in one thread)")
    ax.set_title(f"Against the alternatives, {data['meta']['date']} (results/compare.json)", fontsize=9)
    fig.tight_layout()
    return fig


def crossover(plt) -> object:
    """docs/threads-or-processes.md: 2 worker processes against 2 threads and the serial loop."""
    data = load("compare.json")
    order = ["p", "m", "b", "a"]
    res = data["results"]
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    _bars(ax, [NAMES[s] for s in order], [
        ("2 processes / 2 threads", ORANGE, [res[s]["rows_per_s"]["feeder procs"] / res[s]["rows_per_s"]["feeder"]
                                            for s in order]),
        ("2 processes / serial loop", PURPLE, [res[s]["rows_per_s"]["feeder procs"] / res[s]["rows_per_s"]["serial"]
                                              for s in order]),
    ], "ratio of rows/s (> 1: worker processes are faster)")
    ax.set_title(f"Threads or processes, {data['meta']['date']} (results/compare.json)", fontsize=9)
    fig.tight_layout()
    return fig


def sweeps(plt) -> object:
    """docs/performance.md, "Concurrency sweeps": each fetcher count relative to the serial loop."""
    data = load("compare.json")
    order = ["s-tiny", "s-large", "s-io", "s-cpu"]
    configs = ["1 thr", "2 thr", "3 thr", "auto thr", "1 proc", "2 proc", "auto proc"]
    colors = [BLUE, BLUE, BLUE, GREEN, ORANGE, ORANGE, GREEN]
    fig, axes = plt.subplots(2, 2, figsize=(7.2, 4.8))
    for ax, s in zip(axes.flat, order):
        rows = data["results"][s]["rows_per_s"]
        values = [rows[c] / rows["serial"] for c in configs]
        ax.bar(range(len(configs)), values, color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(["1\nthread", "2\nthreads", "3\nthreads", "auto\nthreads", "1\nprocess", "2\nprocs",
                            "auto\nprocs"], fontsize=7)
        ax.set_title(NAMES[s], fontsize=9)
        ax.set_ylabel("/ serial loop", fontsize=8)
    fig.suptitle(f"Concurrency sweeps: rows/s relative to the serial loop, {data['meta']['date']} "
                 f"(results/compare.json)", fontsize=9)
    fig.tight_layout()
    return fig


def predict(plt) -> object:
    """docs/predict.md, "Speed": rows/s of each way, both models."""
    data = load("predict.json")
    ways = [("hand loop (ORT defaults)", "hand loop", GREY), ("Ray Data", "Ray Data", PURPLE),
            ("feeder.predict", "feeder.predict", BLUE)]
    models = [("model-bound: MLP 64-512-512-16", "model"), ("read-bound: MatMul 64-4", "read")]
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 2.6))
    for ax, (title, key) in zip(axes, models):
        rows = data["scenarios"][key]["rows_per_s"]
        values = [rows[k] / 1000 for _, k, _ in ways]
        ax.barh(range(len(ways)), values, color=[c for _, _, c in ways])
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}k", va="center", fontsize=7)
        ax.set_yticks(range(len(ways)))
        ax.set_yticklabels([n for n, _, _ in ways])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("thousand rows/s")
        ax.set_xlim(0, max(values) * 1.25)
    fig.suptitle(f"1M Parquet rows -> model -> Parquet, {data['date'][:10]} (results/predict.json)", fontsize=9)
    fig.tight_layout()
    return fig


def trace(plt) -> object:
    """docs/gpu.md, "Reading a trace": the trace of 30 batches of a device feed on the CPU
    (``cpu:staged``, benchmarks/gpu.py --small --trace), one row per thread, one bar per span."""
    data = load("trace-cpu-staged.json")["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in data if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in data if e["ph"] == "X"]
    t0 = min(e["ts"] for e in spans)

    def label(tid: int) -> str:
        name = names[tid]
        return "consumer (run, wait)" if name == "MainThread" else name.replace("feeder:train:", "")

    order = sorted(names, key=lambda t: (names[t] != "MainThread", "stream" in names[t], names[t]))
    colors = {"fetch": GREY, "assemble": ORANGE, "copy": PURPLE, "wait": "#e53935", "run": GREEN}
    fig, ax = plt.subplots(figsize=(7.2, 2.8))
    for row, tid in enumerate(order):
        for name, color in colors.items():
            bars = [((e["ts"] - t0) / 1000, max(e["dur"], 5.0) / 1000) for e in spans
                    if e["tid"] == tid and e["name"] == name]
            if bars:
                edge = {"edgecolor": "white", "linewidth": 0.4} if name in ("run", "wait") else {}  # batch by batch
                ax.broken_barh(bars, (row - 0.35, 0.7), facecolor=color, label=name, **edge)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend([seen[k] for k in colors if k in seen], [k for k in colors if k in seen], loc="upper center",
              bbox_to_anchor=(0.5, -0.22), ncol=5, fontsize=7, frameon=False)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([label(t) for t in order], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title("A trace of 30 batches, device path on the CPU (results/trace-cpu-staged.json)", fontsize=9)
    fig.tight_layout()
    return fig


PLOTS: Dict[str, Callable] = {
    "perf-alternatives.svg": alternatives,
    "perf-crossover.svg": crossover,
    "perf-sweeps.svg": sweeps,
    "perf-predict.svg": predict,
    "perf-gpu-trace.svg": trace,
}


def render() -> Dict[str, bytes]:
    """Every plot as the bytes of its SVG."""
    plt = _pyplot()
    out = {}
    for name, draw in PLOTS.items():
        fig = draw(plt)
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


def stale() -> List[str]:
    """The plots whose committed file differs from what :func:`render` draws (or is missing)."""
    return [name for name, svg in render().items()
            if not (IMAGES / name).is_file() or (IMAGES / name).read_bytes() != svg]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the committed plots instead of writing them")
    args = parser.parse_args(list(argv))
    if args.check:
        bad = stale()
        if bad:
            print(f"plots that are not what benchmarks/plots.py draws from benchmarks/results/: {', '.join(bad)}; "
                  f"run python benchmarks/plots.py and commit them", file=sys.stderr)
            return 1
        print(f"{len(PLOTS)} plots match benchmarks/results/")
        return 0
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name, svg in render().items():
        (IMAGES / name).write_bytes(svg)
        print(f"wrote docs/images/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
