#!/usr/bin/env bash
# Soak benchmark: N streaming chat clients for M minutes; tokens/s, errors and RSS per minute.
#   scripts/soak.sh --topology topologies/smollm2-2stage.yaml --streams 16 --minutes 10 [--out DIR]
#   scripts/soak.sh --url http://127.0.0.1:8000/v1 --run-dir runs/two --minutes 10
exec "${VENV:-$(dirname "$0")/../.venv}/bin/python" -m skippy_zmq.devtools.soak "$@"
