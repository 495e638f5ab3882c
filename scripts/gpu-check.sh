#!/usr/bin/env bash
# GPU check, on a machine with one NVIDIA GPU (the first run on an H200 took over 9 minutes; see docs/benchmarks.md):
#   1. installs the `gpu` extra (jax[cuda12]) into the venv if JAX sees no GPU;
#   2. tests/test_parity.py on gpu:0 in float32 and bfloat16 (SKIPPY_TEST_DEVICE / SKIPPY_TEST_DTYPE);
#   3. `skippy-zmq bench single` on gpu:0;
#   4. a 2-stage pipeline bench with both stages on gpu:0, float32 then bfloat16, its greedy tokens
#      compared with one CPU fp32 process;
#   5. the same for a mixture-of-experts model (2 layers of the Qwen3-30B-A3B shape, random weights).
# Prints a table and writes bench-out/gpu/gpu-check.json (plus each step's bench.json and log).
#   scripts/gpu-check.sh [OUT_DIR]      (default bench-out/gpu; VENV=path overrides .venv)
#
# Offline (a GPU machine that reaches no package registry): GPU_WHEELS=DIR holds wheels of the packages
# its Python (SYSTEM_PYTHON, default python3, with JAX for CUDA) lacks: pyzmq, loguru, gguf, fastapi,
# starlette, uvicorn, llguidance, jsonschema, pydantic, ... They are unpacked under OFFLINE_ENV
# (default: a fresh private folder from mktemp -d; a fixed /tmp path is one another user could create
# first and fill with their own code) and found, with this repo, through PYTHONPATH. Without the real
# SmolLM2 in models/ (fetched from the registry) the parity steps are not run and the benches use random
# weights of its shape with its tokenizer (carry models/smollm2-135m-instruct/tokenizer{,_meta}.json).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
OUT="${1:-bench-out/gpu}"
# DEVICE=cpu: a dry run of the same steps on the CPU (no GPU needed; float32 then checks no tokens)
DEVICE="${DEVICE:-gpu:0}"

gpu_visible() {
    { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } ||
        compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null
}
jax_sees_gpu() { "$BIN/python" -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; }

if [ "$DEVICE" != cpu ] && ! gpu_visible; then
    echo "gpu-check: no NVIDIA GPU visible (nvidia-smi lists none); run it on a machine with one" >&2
    exit 2
fi
SYSTEM_PYTHON="${SYSTEM_PYTHON:-python3}"
REAL_MODEL=models/smollm2-135m-instruct
offline_env() {   # the system Python's packages + GPU_WHEELS (a --target dir) + this repo, by PYTHONPATH
    local site="${OFFLINE_ENV:-}"
    if [ -z "$site" ]; then
        site="$(mktemp -d "${TMPDIR:-/tmp}/skippy-offline-env.XXXXXXXX")" || return 1
    elif [ -e "$site" ] && { [ ! -O "$site" ] || [ -n "$(find "$site" -maxdepth 0 -perm /022)" ]; }; then
        echo "gpu-check: OFFLINE_ENV $site is not ours or is group/world-writable; refusing it" >&2
        return 1
    fi
    BIN="$site/bin"
    mkdir -p "$BIN" || return 1
    "$SYSTEM_PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site/lib" \
        "$GPU_WHEELS"/*.whl || return 1
    export PYTHONPATH="$PWD:$site/lib${PYTHONPATH:+:$PYTHONPATH}"
    # wrappers, not links: the system Python may itself be a venv, which a link to it would leave
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$SYSTEM_PYTHON")" >"$BIN/python" &&
        printf '#!/bin/sh\nexec "%s" -m skippy_zmq.cli "$@"\n' "$BIN/python" >"$BIN/skippy-zmq" &&
        chmod +x "$BIN/python" "$BIN/skippy-zmq"
}
if [ -n "${GPU_WHEELS:-}" ]; then
    offline_env || { echo "gpu-check: the offline environment from $GPU_WHEELS failed" >&2; exit 3; }
else
    make install model && "$BIN/pip" install -q -e '.[test,bench]' || { echo "gpu-check: make install model failed" >&2; exit 3; }
fi
if [ "$DEVICE" != cpu ] && ! jax_sees_gpu && [ -n "${GPU_WHEELS:-}" ]; then
    echo "gpu-check: JAX of $SYSTEM_PYTHON sees no GPU (offline: nothing to install)" >&2
    exit 3
elif [ "$DEVICE" != cpu ] && ! jax_sees_gpu; then
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

# Random models take SmolLM2's tokenizer (the benches encode text and chat): from the real model's
# directory, where offline only its tokenizer.json and tokenizer_meta.json need be carried.
if [ ! -f "$REAL_MODEL/tokenizer.json" ]; then
    echo "gpu-check: no $REAL_MODEL/tokenizer.json (make model, or carry it with tokenizer_meta.json)" >&2
    exit 3
fi
random_model() {   # random_model OUT ARGS...: made once, SmolLM2's vocabulary
    local out=$1
    shift
    [ -f "$out/model.json" ] || "$BIN/skippy-zmq" random-model --vocab "$REAL_MODEL" --weights f32 --out "$out" "$@" ||
        { echo "gpu-check: random-model $* failed" >&2; exit 3; }
}
MODEL="${MODEL:-$REAL_MODEL}"
if [ ! -f "$MODEL/model.json" ]; then
    MODEL=models/random/smollm2-135m-f32-vocab
    random_model "$MODEL" --shape smollm2-135m
fi
MOE_MODEL=models/random/qwen3-30b-a3b-L2-f32-vocab
random_model "$MOE_MODEL" --shape qwen3-30b-a3b --layers 2
echo "== gpu-check: model $MODEL; JAX $("$BIN/python" -c 'import jax; print(jax.__version__, jax.devices())')"

if [ "$MODEL" != "$REAL_MODEL" ]; then
    echo "the real SmolLM2 is not in $REAL_MODEL (random weights of its shape instead)" >"$OUT/parity-not-run.txt"
else for dtype in float32 bfloat16; do
    step "parity-$dtype" env SKIPPY_TEST_DEVICE=$DEVICE SKIPPY_TEST_DTYPE=$dtype \
        "$BIN/python" -m pytest -q -p no:cacheprovider tests/test_parity.py --junitxml "$OUT/parity-$dtype.xml"
done; fi
# cheapest first: one process per dtype against the CPU (about a minute on an H200), then the
# pipelines (stage start and compiles dominate: about 3 minutes each there), the single bench last
step tokens "$BIN/python" scripts/gpu_tokens.py "$MODEL" "$MOE_MODEL" --device $DEVICE
for dtype in float32 bfloat16; do
    step "pipeline-$dtype" "$BIN/skippy-zmq" bench pipeline --model "$MODEL" --device $DEVICE --dtype $dtype \
        --stages 2 --quick --out "$OUT/pipeline-$dtype"
    step "moe-$dtype" "$BIN/skippy-zmq" bench pipeline --model "$MOE_MODEL" --device $DEVICE --dtype $dtype \
        --stages 2 --quick --out "$OUT/moe-$dtype"
done
step single "$BIN/skippy-zmq" bench single --model "$MODEL" --device $DEVICE --repeats 1 --out "$OUT/single"

"$BIN/python" -m skippy_zmq.devtools.bench.gpu_check "$OUT" --device $DEVICE --elapsed-s "$SECONDS"
rc=$?
echo "gpu-check: ${SECONDS}s${failed[*]:+; failed steps: ${failed[*]}}"
[ "$SECONDS" -le 480 ] || echo "gpu-check: took longer than the 8-minute budget" >&2
exit $((rc || ${#failed[@]}))
