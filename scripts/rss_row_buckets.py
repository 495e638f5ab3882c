"""How much a stage's peak RSS grows when decode buckets the warm-up skips (4 and 8 rows) are
compiled on first use: one Llama-3.2-1B-shaped q4 stage in process (bench scale's 1B model,
models/random/llama-3.2-1b-L16-s0-q4), VmRSS / VmHWM after READY, after 1-2-row decode (warmed)
and after 4- and 8-row decode at three attention lengths.

    .venv/bin/python scripts/rss_row_buckets.py [MODEL_DIR]
"""
import sys, tempfile
from pathlib import Path
import numpy as np
from skippy_zmq.cli import configure_jax
configure_jax()
from skippy_zmq.devtools.harness import write_topology
from skippy_zmq.stage import factory
from skippy_zmq.config.topology_yaml import load_topology

def vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 2**20
model = Path(sys.argv[1] if len(sys.argv) > 1 else "models/random/llama-3.2-1b-L16-s0-q4").absolute()
tmp = Path(tempfile.mkdtemp())
path = write_topology(tmp, model, 1, name="rows", weights="q4", kv_lanes=8, cache={"mode": "disabled"},
                      driver__max_sessions=8, driver__max_context=656)
topo = load_topology(path)
runner = factory.build_worker(topo, topo.stages[0]).runner
print(f"READY: rss {vm('VmRSS'):.2f} GiB, hwm {vm('VmHWM'):.2f} GiB, buckets rows {runner.buckets.decode_rows}, attn {runner.attn_buckets()}", flush=True)
for rows in (1, 2):
    for pos in (100, 300, 600):
        runner.decode(np.arange(rows), np.zeros(rows, np.int32), np.full(rows, pos))
print(f"1-2 rows served (warmed): rss {vm('VmRSS'):.2f}, hwm {vm('VmHWM'):.2f}", flush=True)
for rows in (4, 8):
    for pos in (100, 300, 600):
        runner.decode(np.arange(rows), np.zeros(rows, np.int32), np.full(rows, pos))
    print(f"{rows} rows at 3 attention lengths (first use): rss {vm('VmRSS'):.2f}, hwm {vm('VmHWM'):.2f}", flush=True)
