#!/usr/bin/env bash
# Start a replacement for stage STAGE_ID of a run started by launch.sh; the driver
# re-prefills paused requests from their token history once it says READY.
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 RUN_DIR STAGE_ID" >&2; exit 2; fi
exec "${VENV:-$(dirname "$0")/../.venv}/bin/skippy-zmq" --log-level WARNING restart-stage "$1" "$2"
