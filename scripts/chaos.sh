#!/usr/bin/env bash
# Chaos: scripts/chaos.sh --topology T --rounds N [--out DIR] [--only mid-stream,restore]
# Launches T, kills stages mid-stream, in a prefill chunk, during a prefix restore, two at once and
# the same one twice, and (first, middle, last) during a json_schema-constrained chat, a forced tool
# call, an n=3 request (--only n3: also at its fork) and a logprobs+echo request (--only json-schema,
# tool-call,n3,logprobs); restarts them; prints scenario / rounds / identical / errors / detect / resume.
set -euo pipefail
exec "${VENV:-$(dirname "$0")/../.venv}/bin/skippy-zmq" --log-level "${SKIPPY_LOG_LEVEL:-WARNING}" chaos "$@"
