#!/usr/bin/env bash
# Benchmarks: scripts/bench.sh [all|single|peers|pipeline|hops|prefix] [--quick] [--out DIR]
# Writes bench.json, bench.md and PNG plots into DIR (default bench-out).
set -euo pipefail
exec "${VENV:-$(dirname "$0")/../.venv}/bin/skippy-zmq" bench "${@:-all}"
