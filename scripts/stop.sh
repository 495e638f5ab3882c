#!/usr/bin/env bash
# Stop every process a launch recorded in RUN_DIR (*.pid): SIGTERM, wait, then SIGKILL.
set -uo pipefail
if [ $# -ne 1 ] || [ ! -d "$1" ]; then echo "usage: $0 RUN_DIR" >&2; exit 2; fi
pids=()
for f in "$1"/*.pid; do
  [ -e "$f" ] || continue
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid" 2>/dev/null && pids+=("$pid"); fi
done
for _ in $(seq 1 100); do            # up to 10 s for a graceful drain
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" -eq 0 ] && break
  sleep 0.1
done
for pid in "${pids[@]}"; do
  if kill -0 "$pid" 2>/dev/null; then echo "pid $pid did not stop; killing it" >&2; kill -KILL "$pid" 2>/dev/null; fi
done
rm -f "$1"/*.pid
echo "stopped ${#pids[@]} process(es)"
