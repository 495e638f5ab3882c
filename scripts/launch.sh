#!/usr/bin/env bash
# Start every stage of TOPOLOGY (downstream first; ssh for a non-local host) and the
# driver in the background; wait for /readyz; print the API URL. Logs and pids in RUN_DIR.
# CURVE keys (the default `security: curve`) are made on first launch, before anything starts,
# in ~/.local/state/skippy_zmq/keys/<digest> (or the topology's keys_dir); a stage on another
# host reads them from the same path there: copy that folder to it once (`scp -rp`).
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 TOPOLOGY [RUN_DIR]" >&2; exit 2; fi
here="$(cd "$(dirname "$0")/.." && pwd)"
topology="$1"
run_dir="${2:-runs/$(basename "${topology%.yaml}")-$(date +%Y%m%d-%H%M%S)}"
exec "${VENV:-$here/.venv}/bin/skippy-zmq" launch "$topology" "$run_dir"
