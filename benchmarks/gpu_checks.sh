#!/usr/bin/env bash
# The GPU checks of issues 27 and 33 in one command, on a machine with a CUDA GPU:
#   1. onnxruntime-gpu from a wheel, if WHEEL_DIR holds one (or its parts, split -b 52m, named
#      onnxruntime_gpu-*.whl.part-*), installed into a folder of its own put first on PYTHONPATH;
#   2. the CUDA and cuDNN libraries of the nvidia-* wheels (a CUDA build of torch brings them) on
#      LD_LIBRARY_PATH, as onnxruntime-gpu needs them;
#   3. the GPU tests (tests/test_gpu.py), then benchmarks/gpu.py with and without CUDA graphs (every
#      column: the model alone, session.run from host, feeder with 2/4/8 threads and 4/8 processes,
#      outputs on the device and on the host, the reference designs, the torch loops when torch has
#      CUDA), a trace of feeder on the GPU, and the issue's targets (the "targets" of the JSON).
#
#   bash benchmarks/gpu_checks.sh [WHEEL_DIR] [RESULTS_DIR]
#
# Results (JSON, the trace and the logs) go to RESULTS_DIR (default benchmarks/results): commit them,
# and the figures into docs/gpu.md. Run from the repository root. Takes about 5 minutes on an H100.
set -uo pipefail
WHEEL_DIR="${1:-}"
RESULTS="${2:-benchmarks/results}"
PY="${PYTHON:-python3}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

if [ -n "$WHEEL_DIR" ]; then
    SITE="${TMPDIR:-/tmp}/feeder-ort-gpu"
    wheel=$(ls "$WHEEL_DIR"/onnxruntime_gpu-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        first=$(ls "$WHEEL_DIR"/onnxruntime_gpu-*.whl.part-* 2>/dev/null | head -1)
        [ -n "$first" ] || { echo "no onnxruntime_gpu wheel or parts in $WHEEL_DIR" >&2; exit 2; }
        wheel="${TMPDIR:-/tmp}/$(basename "${first%.part-*}")"
        cat "$WHEEL_DIR"/onnxruntime_gpu-*.whl.part-* > "$wheel"
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheel" \
        || exit 2
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

libs=$("$PY" - <<'EOF'
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
dirs = sorted({d for r in nvidia.__path__ for d in glob.glob(os.path.join(r, "*", "lib"))})
print(":".join(dirs))
EOF
)
[ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

"$PY" -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

echo "== GPU tests"
"$PY" -m pytest -m gpu -rs -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$RESULTS/gpu-tests.log"
tests=${PIPESTATUS[0]}

echo "== benchmarks/gpu.py"
"$PY" benchmarks/gpu.py --seconds 4 --warmup 2 --probe --json "$RESULTS/gpu-cuda.json" \
    --trace "$RESULTS/trace-cuda.json" 2>&1 | tee "$RESULTS/gpu-bench.log"
"$PY" benchmarks/gpu.py --seconds 4 --warmup 2 --cuda-graph --columns limit host feeder-2t feeder-4t feeder-4p \
    feeder-4t-host feeder-4p-host --json "$RESULTS/gpu-cuda-graph.json" 2>&1 | tee "$RESULTS/gpu-bench-graph.log"

echo "== the issue's targets"
"$PY" - "$RESULTS/gpu-cuda.json" "$RESULTS/gpu-cuda-graph.json" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    data = json.load(open(path))
    print(path, data["meta"]["device"], data["meta"]["provider"])
    for name, t in data.get("targets", {}).items():
        print(f"  {name:55s} {t['ratio']:6.2f}  goal >= {t['goal']:<5}  {'met' if t['met'] else 'NOT MET'}")
    for key, why in data.get("errors", {}).items():
        print(f"  {key}: {why}")
EOF
exit "$tests"
