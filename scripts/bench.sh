#!/usr/bin/env bash
# Benchmarks: scripts/bench.sh [all|single|peers|pipeline|hops|prefix] [--quick] [--out DIR]
# No suite (or only flags) means all. Writes bench.json, bench.md and PNG plots into DIR (default bench-out).
set -euo pipefail
case "${1:-}" in ""|-*) set -- all "$@" ;; esac
exec "${VENV:-$(dirname "$0")/../.venv}/bin/skippy-zmq" bench "$@"
