#!/usr/bin/env bash
# Stop every process a launch recorded in RUN_DIR (*.pid): SIGTERM, wait, then SIGKILL.
# A pid is signalled only if it is still this run's process: its command line is skippy_zmq's, for that
# stage id (`--stage ID`) or the driver, with the run's topology file. Anything else (a pid reused by
# another program, a file someone edited) is reported and skipped.
set -uo pipefail
if [ $# -ne 1 ] || [ ! -d "$1" ]; then echo "usage: $0 RUN_DIR" >&2; exit 2; fi
topology=""
[ -f "$1/topology" ] && topology="$(basename "$(head -n 1 "$1/topology")")"

command_line() {   # PID's argv joined by spaces (with a trailing one), from /proc or ps
    if [ -r "/proc/$1/cmdline" ]; then tr '\0' ' ' <"/proc/$1/cmdline"; else echo "$(ps -o args= -p "$1") "; fi
}

running() {       # PID: still running (a zombie, dead but not yet reaped by its parent, is not: waiting on
    local state                # it drained nothing and cost the whole 10 s when a test held the stage's Popen)
    kill -0 "$1" 2>/dev/null || return 1
    if [ -r "/proc/$1/stat" ]; then state="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)"
    else state="$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)"; fi
    [ "$state" != Z ]
}

run_process() {    # PID NAME: whether PID is this run's NAME ("driver" or a stage id)
    local pid="$1" name="$2" cmd
    [[ "$pid" =~ ^[1-9][0-9]{0,9}$ ]] || return 1       # never 0, -1 or a process group
    cmd="$(command_line "$pid" 2>/dev/null)" || return 1
    [[ "$cmd" == *skippy_zmq* ]] || return 1
    if [ "$name" = driver ]; then [[ "$cmd" == *" driver "* ]] || return 1
    else [[ "$cmd" == *"--stage $name "* ]] || return 1; fi
    [ -z "$topology" ] || [[ "$cmd" == *"$topology"* ]]
}

pids=()
names=()
for f in "$1"/*.pid; do
  [ -e "$f" ] || continue
  pid="$(head -c 32 "$f" | tr -d '[:space:]')"
  name="$(basename "$f" .pid)"
  [[ "$pid" =~ ^[1-9][0-9]{0,9}$ ]] || { echo "skipping $f: ${pid@Q} is not a pid" >&2; continue; }
  kill -0 "$pid" 2>/dev/null || continue
  if ! run_process "$pid" "$name"; then
    echo "skipping $f: pid $pid is not this run's $name (its command line does not match)" >&2
    continue
  fi
  kill -TERM "$pid" 2>/dev/null && pids+=("$pid") && names+=("$name")
done
for _ in $(seq 1 100); do            # up to 10 s for a graceful drain
  alive=0
  for pid in "${pids[@]}"; do running "$pid" && alive=1; done
  [ "$alive" -eq 0 ] && break
  sleep 0.1
done
for i in "${!pids[@]}"; do
  pid="${pids[$i]}"
  if running "$pid" && run_process "$pid" "${names[$i]}"; then
    echo "pid $pid did not stop; killing it" >&2
    kill -KILL "$pid" 2>/dev/null
  fi
done
rm -f "$1"/*.pid
echo "stopped ${#pids[@]} process(es)"
