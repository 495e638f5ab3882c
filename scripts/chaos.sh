#!/usr/bin/env bash
# Chaos: scripts/chaos.sh --topology T --rounds N [--out DIR] [--only mid-stream,restore]
# Launches T, kills stages mid-stream, in a prefill chunk, during a prefix restore, two at once and
# the same one twice; restarts them; prints scenario / rounds / identical / errors / detect / resume.
set -euo pipefail
exec "${VENV:-$(dirname "$0")/../.venv}/bin/skippy-zmq" --log-level "${SKIPPY_LOG_LEVEL:-WARNING}" chaos "$@"
