#!/usr/bin/env bash
# The whole GPU check in one run, under 10 minutes on one H100 (its steps' limits add up to
# 645 s, some in parallel; it took 304 s on 2026-11-26, before the compiled rows, and 460 s
# on 2026-11-28; docs/PERFORMANCE.md (h), "The GPU check"): the CUDA tests, the MNIST examples on
# the GPU, benchmarks/gpu.py, and GPT-2 at GPT-2 small's shape against plain PyTorch on
# the same GPU.
#
#     MNIST_DATA=path/to/data OUT=gpu_logs bash benchmarks/gpu_check.sh
#
# It runs the project from this checkout (PYTHONPATH), so a machine whose torch cannot be
# changed (the GPU machine's image: torch 2.11 and no package index) needs nothing
# installed but pytest, pytest-xdist, tqdm, torchvision and transformers. MNIST is read
# from $MNIST_DATA, else ./shared/data, ../shared/data or ./mnist_data (the raw files
# under MNIST/raw); it is never downloaded. Where ../shared does not travel with the
# checkout, copy it in first (git ignores ./mnist_data): cp -r ../shared/data mnist_data.
# Every step has a time limit and writes its log to $OUT (at most 9 files);
# $OUT/summary.txt has one line per step: its exit status, its seconds and the lines that
# matter (accuracy, ratios, the test counts).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_logs}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
DATA=${MNIST_DATA:-}
for d in shared/data ../shared/data mnist_data; do
    [ -z "$DATA" ] && [ -e "$d/MNIST/raw/train-images-idx3-ubyte" ] && DATA=$d
done
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS GREP COMMAND...: run COMMAND with a limit, log to $OUT/NAME.log, and put
# its status, time and the log's lines matching GREP in the summary.
step() {
    local name=$1 limit=$2 pattern=$3; shift 3
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    note "== $name: rc $rc$([ $rc = 124 ] && echo ' (TIMED OUT)') in $((SECONDS - start)) s (limit $limit s)"
    grep -E "$pattern" "$OUT/$name.log" | tail -n 12 | sed 's/^/   /' | tee -a "$SUMMARY"
}

note "gpu_check $(date -u +%Y-%m-%dT%H:%MZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch
print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}; "
      f"{torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
EOF
[ -n "$DATA" ] || note "no MNIST found (set MNIST_DATA): the example steps will fail"

# 1. Correctness, all at once (nothing here is timed): the CUDA tests on 6 workers, the
#    fuzzer's short profile on CUDA and the MNIST examples on the GPU beside them. The pipelined example trains its full 3 epochs.
step tests 150 "passed|failed|error|FAILED|ERROR" \
    $PY -m pytest -q -m cuda -n 6 -p no:cacheprovider tests &
step mnist 120 "Accuracy|Error|error" \
    $PY examples/mnist.py --data-dir "$DATA" --epochs 1 --limit 16000 &
step mnist_pipelined 150 "Accuracy|effective|Error|error" \
    $PY examples/mnist_pipelined.py --data-dir "$DATA" &
# The differential fuzzer's short profile with every drawn configuration on the GPU, plain
# PyTorch on the GPU beside it (tests/support/fuzz_config.py). It needs Hypothesis, which the GPU
# image lacks: carry its wheels in an ignored wheels/ (pip download hypothesis -d wheels).
if ! $PY -c "import hypothesis" 2>/dev/null && [ -d wheels ]; then
    $PY -m pip install -q --no-index --find-links wheels --target /tmp/gpu_check_pylib \
        hypothesis > /dev/null 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_pylib"
fi
step fuzz_cuda 150 "passed|failed|Finding|rror" env POPTORCH_LITE_FUZZ_DEVICE=cuda \
    $PY -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k drawn_models_match &
wait
# The same pipeline trained by plain PyTorch on the GPU, step for step (its numbers against
# poptorch_lite's, within float tolerance), over the first 200 steps.
step mnist_match 45 "same numbers|FAILED|Error|error" \
    $PY benchmarks/gpu_mnist_match.py --data-dir "$DATA" --steps 200

# 2. Speed and memory, alone on the GPU: the step tax of one stage and of two streams on one
#    GPU (with their timelines' overlap), eager and with compileStages (the "+c" rows:
#    Inductor's stages, each step one CUDA graph; "+g": the eager kernels in one CUDA graph),
#    then GPT-2 small's shape, eager and compiled. The CUDA tests of step 1 include the
#    compiled column (tests/compiler/test_compiled_stages.py) and the step graphs
#    (tests/runtime/test_step_graph.py) on cuda.
#    With plain PyTorch under torch.compile(mode="reduce-overhead") as the anchor ("+ro", and
#    each +c/+g row's ratio to it): five processes per pair (it timed out at 240 s with four on
#    2026-11-28, so 300 s and 20 timed calls).
step gpu_bench 300 "x |ratio|overlap|peak|mlp|conv|pipe|reduce-overhead|Error|error" \
    $PY benchmarks/gpu.py --case mlp conv pipe1 --pairs 2 --calls 20 --compiled
# Where a one-stage step's host time goes (torch.profiler: host ops, CUDA runtime calls).
step profile 30 "Self CPU time total|cudaLaunchKernel |cudaEventRecord|pin_memory|Memcpy|Error" \
    $PY benchmarks/gpu.py --side lite --case conv --calls 30 --profile
step gpt2 120 "poptorch_lite|plain|model|Error|error" \
    $PY benchmarks/gpt2.py --device cuda --width 768 --layers 12 --seq 512 --micro-batch 4 \
        --microbatches 8 --torch-schedules "" --repeats 5 --warmup 3 \
        --schedules "grouped,interleaved,interleaved+recompute,grouped+compiled"
note "gpu_check done in $SECONDS s"
