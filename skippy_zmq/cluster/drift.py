"""Drift: a stage whose measured step times have left the plan (its host got slower or faster).

Every reply carries a trace of each stage's compute time and rows (stage/worker.py `_trace`).
Per stage, an average of measured ÷ planned compute time (the planned time is the worker's own
measurement for that many rows and layers: ops/speed.HostSpeed). A uniform bias (every host a
little slower than it measured) moves every ratio alike and changes no split, so drift is the
worst stage's ratio over the best's; when it stays above `threshold` for `window_s` the rebalancer
re-cuts, with each worker's measurement scaled by its ratio over the best (the fresh numbers).
Any other re-cut (`skippy-zmq rebalance`, a worker gone or joined) takes the fresh numbers too
(`refresh`): a host that slowed down is planned at the speed its replies show, not at the speed it
measured when it joined. The scale applies to the plan at once, so the ratios that follow measure
what is left over, and a split that stays as it is does not drift again on the same slowdown.
"""

from __future__ import annotations

import threading
from typing import Any, Collection, Mapping

from skippy_zmq.config.topology import Topology
from skippy_zmq.ops.speed import HostSpeed, SpeedPlanError

ALPHA = 0.05          # the average's weight of one sample
MIN_SAMPLES = 30      # per stage, before its ratio counts
TIME_KEYS = ("layer_ms", "step_ms", "head_ms", "sample_ms", "message_ms")


def scale_measure(speed: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """A measure_host result with every time multiplied by `factor`."""
    out = dict(speed)
    out["decode"] = {rows: {k: _scaled(k, v, factor) for k, v in entry.items()}
                     for rows, entry in speed.get("decode", {}).items()}
    prefill = dict(speed.get("prefill", {}))
    if "layer_ms_per_token" in prefill:
        prefill["layer_ms_per_token"] = prefill["layer_ms_per_token"] * factor
    out["prefill"] = prefill
    return out


def _scaled(key: str, value: Any, factor: float) -> Any:
    """A time x factor; the CPU figures (a dict of times) each alike; anything else as it is."""
    if key == "cpu" and isinstance(value, Mapping):
        return {k: (v * factor if k in TIME_KEYS else v) for k, v in value.items()}
    return value * factor if key in TIME_KEYS else value


class DriftMonitor:
    """Fed from the pipeline thread (`observe`), read by the rebalancer's (`check`, `scaled`, `reset`)."""

    def __init__(self, threshold: float, window_s: float):
        self.threshold, self.window_s = threshold, window_s
        self.lock = threading.Lock()
        self.scale: dict[str, float] = {}                          # worker -> its measurement's factor
        self.plan: dict[str, tuple[str, HostSpeed, int, bool]] = {}   # stage -> worker, speed (unscaled), layers, last
        self.ratio: dict[str, float] = {}
        self.samples: dict[str, int] = {}
        self.since: float | None = None

    def scaled(self, name: str, speed: Mapping[str, Any]) -> dict[str, Any]:
        factor = self.scale.get(name, 1.0)
        return dict(speed) if factor == 1.0 else scale_measure(speed, factor)

    def reset(self, topology: Topology, workers: Mapping[str, Any]) -> None:
        """A new split: what each stage is planned to take (workers: name -> WorkerRecord)."""
        plan = {}
        for w in workers.values():
            speed = w.measured or (w.started or {}).get("speed")
            if w.stage is None or not speed or w.stage not in {s.id for s in topology.stages}:
                continue
            stage = topology.stage(w.stage)
            try:
                host = HostSpeed.from_measure(speed, name=w.name)   # observe() applies the worker's scale
            except SpeedPlanError:
                continue
            plan[stage.id] = (w.name, host, stage.end - stage.start, stage.id == topology.stages[-1].id)
        with self.lock:
            self.plan, self.ratio, self.samples, self.since = plan, {}, {}, None

    def observe(self, trace: Any, warming: Collection[str] = ()) -> None:
        """A reply's trace. Only decode steps count (one position a row: a prefill chunk or a verify
        window is not what the plan's step times are for), and not a stage still compiling its
        shapes (`warming`: a stage just started runs layer by layer while its fused steps compile
        beside serving, for a minute on a slow host; counted, that looked like drift and re-cut
        again and again)."""
        if not isinstance(trace, list) or self.threshold == 0:
            return
        with self.lock:
            for entry in trace:
                step = _decode_step(entry)
                if step is None or step[0] not in self.plan or step[0] in warming:
                    continue
                stage, rows, measured = step
                name, host, layers, last = self.plan[stage]
                planned = layers * host.at(host.layer_ms, rows) + (host.at(host.head_ms, rows) if last else 0.0)
                planned *= self.scale.get(name, 1.0)
                if planned <= 0 or measured <= 0:
                    continue
                old = self.ratio.get(stage)
                self.ratio[stage] = measured / planned if old is None else old + ALPHA * (measured / planned - old)
                self.samples[stage] = self.samples.get(stage, 0) + 1

    def _counted(self) -> dict[str, float]:
        return {s: r for s, r in self.ratio.items() if self.samples.get(s, 0) >= MIN_SAMPLES}

    def _rescale(self, ratios: Mapping[str, float]) -> None:
        """Each worker's factor times its stage's ratio over the best; the averages start again
        (they were taken against the old factors). Under self.lock."""
        best = min(ratios.values())
        for stage, ratio in ratios.items():
            name = self.plan[stage][0]
            self.scale[name] = self.scale.get(name, 1.0) * ratio / best
        self.ratio, self.samples, self.since = {}, {}, None

    def refresh(self) -> dict[str, float]:
        """Before any re-cut plans: take the fresh numbers the replies show (when every stage has
        enough of them); the factors after."""
        with self.lock:
            ratios = self._counted()
            if len(ratios) >= 2 and len(ratios) == len(self.plan):
                self._rescale(ratios)
            return dict(self.scale)

    def check(self, now: float) -> str | None:
        """The reason to re-cut when drift stayed over the threshold for the window (and the
        factors the next plan scales the workers' measurements by), else None."""
        with self.lock:
            ratios = self._counted()
            if self.threshold == 0 or len(ratios) < 2:
                return None
            worst, best = max(ratios, key=ratios.get), min(ratios, key=ratios.get)
            drift = ratios[worst] / ratios[best]
            if drift <= self.threshold:
                self.since = None
                return None
            if self.since is None:
                self.since = now
            if now - self.since < self.window_s:
                return None
            self._rescale(ratios)
            return (f"stage {worst} on worker {self.plan[worst][0]} runs {drift:.2f}x slower than planned "
                    f"beside stage {best} (threshold {self.threshold:g}, for {self.window_s:g} s)")


def _decode_step(entry: Any) -> tuple[str, int, float] | None:
    """(stage, rows, compute ms) of a trace entry that is a decode step (one token a row), else None;
    a malformed entry (a stage's bug) is skipped, never raised on the pipeline thread."""
    if not isinstance(entry, dict) or not isinstance(entry.get("stage"), str):
        return None
    try:
        rows = max(1, int(entry.get("rows") or 1))
        tokens = int(entry.get("tokens") or rows)
        measured = float(entry.get("compute_ms") or 0.0)
    except (TypeError, ValueError):
        return None
    return (entry["stage"], rows, measured) if tokens == rows else None
