#!/usr/bin/env bash
# GPU check, on a machine with one NVIDIA GPU (about 6 minutes on an H100-class card):
#   1. installs the `gpu` extra (jax[cuda12]) into the venv if JAX sees no GPU;
#   2. tests/test_parity.py on gpu:0 in float32 and bfloat16 (SKIPPY_TEST_DEVICE / SKIPPY_TEST_DTYPE);
#   3. `skippy-zmq bench single` on gpu:0;
#   4. a 2-stage pipeline bench with both stages on gpu:0, float32 then bfloat16, its greedy tokens
#      compared with one CPU fp32 process.
# Prints a table and writes bench-out/gpu/gpu-check.json (plus each step's bench.json and log).
#   scripts/gpu-check.sh [OUT_DIR]      (default bench-out/gpu; VENV=path overrides .venv)
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
OUT="${1:-bench-out/gpu}"
DEVICE=gpu:0

gpu_visible() {
    { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } ||
        compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null
}
jax_sees_gpu() { "$BIN/python" -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; }

if ! gpu_visible; then
    echo "gpu-check: no NVIDIA GPU visible (nvidia-smi lists none); run it on a machine with one" >&2
    exit 2
fi
if ! jax_sees_gpu; then
    echo "gpu-check: JAX sees no GPU; installing the gpu extra (jax[cuda12]) into $BIN/.." >&2
    "$BIN/pip" install -q -e '.[gpu]' || { echo "gpu-check: pip install -e '.[gpu]' failed" >&2; exit 3; }
    jax_sees_gpu || { echo "gpu-check: JAX still sees no GPU after installing .[gpu]" >&2; exit 3; }
fi

# Stages, the driver and the tests share one GPU: allocate on demand, not 75% per process up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# float32 matmuls on the GPU otherwise run in TF32 (10-bit mantissa), which parts greedy tokens from
# the CPU's; JAX_DEFAULT_MATMUL_PRECISION=default measures the TF32 speed instead.
export JAX_DEFAULT_MATMUL_PRECISION="${JAX_DEFAULT_MATMUL_PRECISION:-highest}"
mkdir -p "$OUT"
SECONDS=0
failed=()
step() {   # step NAME COMMAND...: run, log to OUT/NAME.log, remember a failure and carry on
    local name=$1
    shift
    echo "== gpu-check: $name (${SECONDS}s)"
    "$@" 2>&1 | tee "$OUT/$name.log" || failed+=("$name")
}

for dtype in float32 bfloat16; do
    step "parity-$dtype" env SKIPPY_TEST_DEVICE=$DEVICE SKIPPY_TEST_DTYPE=$dtype \
        "$BIN/python" -m pytest -q -p no:cacheprovider tests/test_parity.py --junitxml "$OUT/parity-$dtype.xml"
done
step single "$BIN/skippy-zmq" bench single --device $DEVICE --repeats 2 --out "$OUT/single"
for dtype in float32 bfloat16; do
    step "pipeline-$dtype" "$BIN/skippy-zmq" bench pipeline --device $DEVICE --dtype $dtype --stages 2 \
        --out "$OUT/pipeline-$dtype"
done

"$BIN/python" -m skippy_zmq.bench.gpu_check "$OUT" --device $DEVICE --elapsed-s "$SECONDS"
rc=$?
echo "gpu-check: ${SECONDS}s${failed[*]:+; failed steps: ${failed[*]}}"
[ "$SECONDS" -le 480 ] || echo "gpu-check: took longer than the 8-minute budget" >&2
exit $((rc || ${#failed[@]}))
