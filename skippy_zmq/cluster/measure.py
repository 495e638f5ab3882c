"""How fast this host runs a model's layers: measured here, on this process's device, with the
model's real layer shapes and weight format, so a planner can split layers by measured speed.

`measure_host(model_dir)` restores ONE stage's worth of the checkpoint, the last layer with the
final norm and head (the only slice whose items a host needs beyond its layers), in the weight
format the stages will run, and times real `SliceRunner` steps on it:

- decode steps of 1, 4 and 8 rows (one token each) through 1 layer and through a stack of
  copies of that layer (`stack_layers`: enough to leave the caches, as a stage's layers do):
  the difference is the time per layer, the rest is what every
  step pays once (dispatch, padding, copying the activation in and out);
- the head (final norm + logits over the vocabulary) of the last stage, per row count, read after
  the stack as a last stage reads it after its layers: from memory, not from a cache a loop of
  one layer + head keeps it in (28 MB for SmolLM2: 2.0 ms a call in that loop on the 2-core
  Xeon, 3.9 after the stack, h100's stages with the head served as predicted then). Under a CPU
  quota after one layer: that loop stalls every period and reads the head cold as it is (h50's and
  h25's heads: ~3.6 ms of full-speed CPU a call);
- a prefill chunk of `CHUNK` tokens, per token per layer;
- a decode message encoded, sent over ZeroMQ TCP loopback, received and decoded (a stage's
  software per hop), and greedy sampling of the logits (the final stage's);
- a stage's own software per step besides its compute: a real StageWorker handling real DECODE
  frames on the one-layer runner, less the compute its trace reports (cluster/software.py);
- under a CPU quota, what ops/speed.py's burst model needs (`quota_burst`): a loop keeps a host
  busy and measures the quota's sustained speed; a pipeline leaves a host idle between its
  steps, so a short step runs flat out on the period's budget (ops/speed.py `throttled_ms`).

Medians of `repeats` timed calls after one warm-up call (compiles happen there). Plus the
host's cores (and a cgroup CPU quota when one caps this process), memory total and available.
The result is a plain, JSON-able dict (`SCHEMA` names its version); ops/speed.py plans from it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from skippy_zmq.cluster import software
from skippy_zmq.config import cpus

SCHEMA = "skippy-host-speed/1"
ROWS = (1, 4, 8)       # decode rows measured (row buckets); the planner interpolates between them
STACK = 9              # layers in the stacked runner at least: (t(k) - t(1)) / (k - 1) is one layer
STACK_BYTES = 256 << 20   # ... and as many more (up to the model's layers) as make this many bytes
CHUNK = 64             # prefill chunk measured (a Buckets.prefill_chunks size)
POSITION = 128         # decode position (default): inside the first attention bucket, like a short chat
# ... the decode attention reads the positions up to the row's own: SmolLM2 q4's layer at position 44
# took 0.203-0.204 ms against 0.219-0.221 at 128 (1 row, 2 pairs, in process), so a workload of
# shorter or longer contexts is measured at its own (`measure_host(position=)`, bench cluster's 44)
CAPACITY = 512         # KV positions of the measuring runners (small: nothing here needs more)
RETRIES = 2            # re-measurements of a row count whose layer time came out <= 0
SOURCES = ("checkpoint", "random")   # where the measured layer's weights come from (measure_host)
SAMPLE_S = 0.1         # one timing sample: a loop of the step this long (ten 10 ms quota periods)
# FOR TESTS ONLY (as cluster/report.py's SKIPPY_TEST_SPEED_SCALE): a timing sample's seconds instead of
# SAMPLE_S. The loops are ~12 s of a measurement's 13 (the tiny test model); a test whose hosts differ
# 10x by that scale needs no precise figures. Never set it in production.
TEST_SAMPLE_S_ENV = "SKIPPY_TEST_MEASURE_SAMPLE_S"
CFS_KEEP_MS = 1.0      # runtime a core keeps for a throttled group gone idle (kernel/sched/fair.c min_cfs_rq_runtime)


def _median_ms(calls: dict[str, Callable[[], Any]], repeats: int,
               cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Per call, the median ms of `repeats` samples, taken round-robin (so a neighbour's burst
    lands on every call alike). A sample times a loop of the call long enough (SAMPLE_S) to span
    several scheduler slices: a sub-millisecond step timed alone measures the scheduler, not the
    step. One untimed call each first: compiles and first-run costs. `cpu`, when given, gets the
    median process CPU ms a call of the same samples (no quota's stall and no neighbour's turn in
    it: what a step started idle spends, where the wall clock of a throttled loop is the sustained
    rate)."""
    loops, sample_s = {}, float(os.environ.get(TEST_SAMPLE_S_ENV) or SAMPLE_S)
    for name, call in calls.items():
        call()
        t0 = time.perf_counter()
        call()
        loops[name] = max(1, min(200, int(sample_s / max(time.perf_counter() - t0, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    cpus_: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(loops[name]):
                call()
            samples[name].append((time.perf_counter() - t0) / loops[name])
            cpus_[name].append((time.process_time() - c0) / loops[name])
    if cpu is not None:
        cpu.update({name: 1000 * statistics.median(times) for name, times in cpus_.items()})
    return {name: 1000 * statistics.median(times) for name, times in samples.items()}


def _split_ms(ms: dict[str, float], rows: int, k: int, under: str) -> dict[str, float]:
    """{layer_ms, step_ms, head_ms} of one row count from its timed calls (one layer, the k-layer
    stack, the head after `under`), as measure_host splits its wall-clock figures; beside them in
    CPU ms (`cpu`), what ops/speed.py plans a quota'd host's idle-started 1-row step from."""
    one, layer = ms[f"one_{rows}"], max(0.0, (ms[f"stack_{rows}"] - ms[f"one_{rows}"]) / (k - 1))
    return {"layer_ms": round(layer, 4), "step_ms": round(max(0.0, one - layer), 4),
            "head_ms": round(max(0.0, ms[f"head_{rows}"] - ms[f"{under}_{rows}"]), 4)}


def _position(position: int) -> int:
    """A decode position inside the measuring runners' KV (what is measured, and recorded)."""
    return min(max(0, int(position)), CAPACITY - 1)


def _decode_call(runner: Any, rows: int, output: str, position: int = POSITION) -> Callable[[], Any]:
    width = runner.cfg.d_model
    inputs = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
    lanes, positions = np.arange(rows, dtype=np.int32), np.full(rows, _position(position), np.int32)
    return lambda: runner.decode(lanes, inputs, positions, output=output)


def _prefill_call(runner: Any) -> Callable[[], Any]:
    inputs = np.random.default_rng(0).standard_normal((CHUNK, runner.cfg.d_model)).astype(np.float32)
    return lambda: runner.prefill(0, inputs, 0, output="hidden")


def quota_burst(quota_cores: float, period_ms: float) -> dict[str, float]:
    """What ops/speed.py's burst model needs of a host under a CPU quota of quota_cores every
    period_ms: `idle_ratio`, a step started idle ÷ the same step in a busy loop, is the quota
    itself (a decode step is one thread's work: idle, it runs flat out; busy, at the quota's
    rate: a process under a quota below a core runs one thread, config/cpus.py), and `burst_ms`,
    what it runs before its first stall: the period's budget and the CFS_KEEP_MS of runtime the
    kernel leaves on a core of an idle group.

    Not timed: an idle-started call fitted through the model (an earlier version) measured the
    quota only where the call ended within about one budget: on the model-deep stack (stack_layers,
    30 layers, about 49 ms busy at 25% of a core) the budget saved 2.5 ms, inside the noise of nine
    samples, and a 25% host came out at 1.0, its short steps predicted 4x slow; on one layer the
    wake-up cost as much as the step (a 50% host at 0.98)."""
    if quota_cores <= 0 or period_ms <= 0 or quota_cores >= 1:
        return {"idle_ratio": 1.0, "burst_ms": 0.0}
    return {"idle_ratio": round(quota_cores, 4), "burst_ms": round(quota_cores * period_ms + CFS_KEEP_MS, 4)}


def _message_ms(width: int, rows: int, repeats: int) -> float:
    """One DECODE message of `rows` f32 activations encoded, sent over a real ZeroMQ TCP loopback
    link, received and decoded: what a stage's software pays per hop at this host's speed."""
    import zmq

    from skippy_zmq.protocol import transport, wire

    msg = wire.Message(wire.Kind.DECODE, 1, 1, position=POSITION, tokens=np.zeros(rows, np.int32),
                       positions=np.full(rows, POSITION, np.int32), sessions=np.arange(1, rows + 1, dtype=np.uint64),
                       activation=np.zeros((rows, width), np.float32))
    ctx = transport.context()
    pull = transport.make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:*", bind=True)
    push = transport.make_socket(ctx, zmq.PUSH, transport.bound_endpoint(pull), bind=False)
    try:
        def hop() -> None:
            transport.send_message(push, msg)
            wire.decode(transport.recv_frames(pull))
        return _median_ms({"hop": hop}, repeats)["hop"]
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def _sample_ms(vocab: int, rows: int, repeats: int) -> float:
    """Greedy sampling of `rows` rows of logits (the final stage's argmax per row)."""
    logits = np.random.default_rng(rows).standard_normal((rows, vocab)).astype(np.float32)
    return _median_ms({"sample": lambda: [int(np.argmax(row)) for row in logits]}, repeats)["sample"]


def _runners(model_dir: Path, weights: str, dtype: str, device: Any, source: str = "checkpoint",
             seed: int = 0) -> tuple[Any, Any]:
    """(one layer + final norm + head as a last stage holds them, copies of that layer ending a
    model with that head: its hidden output times the layers, its logits the head read after
    them). source "checkpoint": the layer is read from the checkpoint (one middle layer's
    items, converted to `weights`); "random": made from model.json alone (`_random_layer`), for a
    worker that holds no weights yet. The head is random in its runtime format (`_random_head`):
    building the real one from a float checkpoint quantises the whole embedding, seconds of CPU
    that say nothing of speed."""
    from skippy_zmq.config.model import KVConfig
    from skippy_zmq.model.runner import SliceRunner

    n = load_slice_config(model_dir).n_layers
    middle = n // 2
    if source == "random":
        cfg, layer = _random_layer(model_dir, middle, weights, dtype, device, seed)
    elif source == "checkpoint":
        from skippy_zmq.checkpoint.loader import load_slice

        cfg, params = load_slice(model_dir, middle, middle + 1, dtype, device, fmt=weights)
        layer = params["layers"][0]
    else:
        raise ValueError(f"measure source must be one of {SOURCES}, got {source!r}")
    kv = KVConfig(lanes=max(ROWS), capacity=min(CAPACITY, cfg.max_seq_len), dtype="float32")
    last = SliceRunner(cfg, {"layers": (layer,), **_random_head(cfg, weights, device)}, n - 1, n, kv, device=device)
    # the stack ends a model of k + 1 layers (no embedding; the same head arrays as `last`). Its
    # layers are copies in memory of their own: one array read k times stays in the core's
    # cache, where a stage's distinct layers stream from memory (half the speed here, 2 MiB L2)
    k = stack_layers(n, _nbytes(layer))
    inner = dataclasses.replace(cfg, n_layers=k + 1)
    head = {key: value for key, value in last.params.items() if key != "layers"}
    stack = SliceRunner(inner, {"layers": tuple(_copy(layer) for _ in range(k)), **head}, 1, 1 + k, kv,
                        device=device)
    return last, stack


def stack_layers(n_layers: int, layer_bytes: int) -> int:
    """Copies of the layer the stack holds: STACK, or up to the model's layers while they make
    fewer than STACK_BYTES. On the 2-core test Xeon nine SmolLM2 q4 layers (20 MB) stayed in its
    last-level cache where a stage's 28 (60 MB) streamed from memory: stages served their layers
    1.8x slower than measured (0.55-0.63 ms against 0.31-0.35, bench cluster)."""
    want = -(-STACK_BYTES // max(1, layer_bytes))
    return max(STACK, min(n_layers, want))


def _nbytes(tree: Any) -> int:
    import jax

    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def _copy(tree: Any) -> Any:
    """A copy of a pytree of device arrays, each in memory of its own."""
    import jax

    return jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, tree)


def _random_layer(model_dir: Path, index: int, weights: str, dtype: str, device: Any,
                  seed: int) -> tuple[Any, dict[str, Any]]:
    """(config, layer `index` in runtime form): random values (seeded) of the model's real layer
    shapes (model.json), in the stage's weight format. A checkpoint's own GGUF blocks ("gguf",
    "auto") are timed as q4, the kernel's format that most GGUF matrices (Q4_0 / Q4_1) become."""
    import jax.numpy as jnp

    from skippy_zmq.model import weights as model_weights

    cfg = dataclasses.replace(load_slice_config(model_dir), dtype=dtype)
    rng = np.random.default_rng(seed)
    layer = {k: ((1.0 if k.endswith("norm") else 0.0) + 0.05 * rng.standard_normal(shape)).astype(np.float32)
             for k, shape in model_weights.layer_shapes(cfg, index).items()}
    quantize = {"int8": "int8", "q4": "q4", "gguf": "q4", "auto": "q4"}.get(weights)
    out = model_weights.to_runtime({"layers": {str(index): layer}}, jnp.dtype(dtype), device, quantize=quantize)
    out = dict(out["layers"][0])
    if weights == "bf16":   # bf16 matrices, float norms (as checkpoint/runtime.py loads them)
        out.update({k: out[k].astype(jnp.bfloat16) for k in model_weights.QUANT_KEYS if k in out})
    return cfg, out


def _random_head(cfg: Any, weights: str, device: Any) -> dict[str, Any]:
    """The final norm and head of a last stage, random, in the runtime layout checkpoint.to_runtime
    gives `weights`: int8 levels packed (the head is int8 under int8 and q4, tied or not), else a
    float [V, D] embedding read by the tied head or a float [D, V] head."""
    import jax
    import jax.numpy as jnp

    from skippy_zmq.model import quant

    rng = np.random.default_rng(0)
    v, d = cfg.vocab_size, cfg.d_model
    out: dict[str, Any] = {"norm": jax.device_put(jnp.ones((d,), jnp.dtype(cfg.dtype)), device)}
    if weights in ("int8", "q4"):
        groups = d // quant.GROUP_SIZE if d % quant.GROUP_SIZE == 0 else 1
        levels = rng.integers(-127, 128, (v, d), dtype=np.int8)
        scales = np.full((v, groups), 1e-3, np.float32)
        out["head"] = jax.device_put(quant.pack_rows(levels, scales, np.zeros_like(scales), bits=8), device)
        return out
    float_dtype = jnp.bfloat16 if weights == "bf16" else jnp.dtype(cfg.dtype)
    table = rng.standard_normal((v, d), np.float32) * 0.02
    key, array = ("embed", table) if cfg.tied_embeddings else ("head", np.ascontiguousarray(table.T))
    out[key] = jax.device_put(jnp.asarray(array, float_dtype), device)
    return out


def load_slice_config(model_dir: Path) -> Any:
    from skippy_zmq.checkpoint.loader import read_model_json

    return read_model_json(Path(model_dir) / "model.json")


def host_facts() -> dict[str, Any]:
    """Cores (and the cgroup v1/v2 CPU quota capping this process, as cores), memory total and available."""
    facts: dict[str, Any] = {"cores": os.cpu_count() or 1, "cpu": _cpu_name()}
    try:
        facts["cores_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        facts["cores_usable"] = facts["cores"]
    quota = cpus.cpu_quota()
    # the threads this process's JAX pool runs (config/cpus.py: ceil(quota), its CPUs at most): one
    # under a quota below a core, so a step is one thread's work, as ops/speed.py counts it
    facts["cpu_threads"] = cpus.jax_threads()
    if quota is not None:
        facts["cpu_quota_cores"] = round(quota[0], 3)
        facts["cpu_period_ms"] = round(quota[1], 3)
    meminfo = _meminfo()
    facts["memory_total"] = meminfo.get("MemTotal", 0)
    facts["memory_available"] = meminfo.get("MemAvailable", 0)
    return facts


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * 1024
    except OSError:
        pass
    return out


def cpu_quota_cores(proc_cgroup: Path = cpus.PROC_CGROUP, root: Path = cpus.CGROUP_ROOT) -> float | None:
    """The CPU quota over this process's cgroup, in cores (None when uncapped or unreadable):
    config/cpus.cpu_quota's."""
    quota = cpus.cpu_quota(proc_cgroup, root)
    return None if quota is None else quota[0]


def measure_host(model_dir: Path | str, weights: str = "q4", dtype: str = "float32", device: str = "cpu",
                 repeats: int = 5, name: str = "", source: str = "checkpoint", seed: int = 0,
                 position: int = POSITION) -> dict[str, Any]:
    """Measured step times of `model_dir`'s layers on `device` in `weights` format (module docstring),
    decode steps at `position`. source "random": from model.json alone (random layer values seeded by
    `seed`, the real shapes and format), for a cluster worker that measures before it holds weights."""
    from skippy_zmq.model.runner import resolve_device

    t_start, model_dir = time.perf_counter(), Path(model_dir)
    last, stack = _runners(model_dir, weights, dtype, resolve_device(device), source, seed)
    k = stack.end - stack.start     # the stack's layers (stack_layers)
    load_s = time.perf_counter() - t_start
    calls = {"prefill_one": _prefill_call(last), "prefill_stack": _prefill_call(stack)}
    # the head after the stack's layers where nothing throttles (module docstring); under a quota the
    # one-layer loop stalls every period and reads it cold anyway, where a difference of two throttled
    # stack calls is where their stalls fell (bench cluster: h50's head came out half of its own loop's)
    quota = min(1.0, cpu_quota_cores() or 1.0)
    under, head_runner = ("one", last) if quota < 1.0 else ("stack", stack)
    for rows in ROWS:
        calls.update({f"one_{rows}": _decode_call(last, rows, "hidden", position),
                      f"stack_{rows}": _decode_call(stack, rows, "hidden", position),
                      f"head_{rows}": _decode_call(head_runner, rows, "logits", position)})
    cpu: dict[str, float] = {}
    ms = _median_ms(calls, repeats, cpu)
    for _ in range(RETRIES):   # a stack no slower than one layer: a neighbour's burst hit the one-layer samples
        bad = [r for r in ROWS if ms[f"stack_{r}"] <= ms[f"one_{r}"]]
        if not bad:
            break
        ms.update(_median_ms({k: calls[k] for r in bad for k in (f"one_{r}", f"stack_{r}")}, repeats, cpu))
    decode: dict[str, dict[str, float]] = {}
    # a stage's software is timed between its steps' compute, where a quota's throttling lands
    # (its median is the CPU time): at the sustained rate a host at q cores pays it 1/q times over
    for rows in ROWS:
        decode[str(rows)] = {**_split_ms(ms, rows, k, under),
                             "sample_ms": round(_sample_ms(last.cfg.vocab_size, rows, repeats), 4),
                             "message_ms": round(_message_ms(last.cfg.d_model, rows, repeats), 4),
                             "software_ms": round(software.handle_ms(last, rows, max(ROWS), repeats)["software_ms"]
                                                  / quota, 4),
                             "cpu": _split_ms(cpu, rows, k, under)}
    prefill_layer, p_one = max(0.0, (ms["prefill_stack"] - ms["prefill_one"]) / (k - 1)), ms["prefill_one"]
    facts = host_facts()
    if facts.get("cpu_period_ms"):
        facts.update(quota_burst(facts.get("cpu_quota_cores") or 1.0, facts["cpu_period_ms"]))
    return {"schema": SCHEMA, "name": name or os.uname().nodename, "model": str(model_dir), "weights": weights,
            "dtype": dtype, "device": device, "source": source, "layers": last.cfg.n_layers, "stack_layers": k,
            "decode": decode, "position": _position(position),
            "prefill": {"chunk": CHUNK, "layer_ms_per_token": round(prefill_layer / CHUNK, 5),
                        "step_ms": round(max(0.0, p_one - prefill_layer), 4)},
            "kernels": last.kernels(), **facts, "load_s": round(load_s, 2),
            "measure_s": round(time.perf_counter() - t_start, 2)}
