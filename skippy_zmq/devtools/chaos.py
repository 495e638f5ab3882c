"""Chaos runs: kill stages at exact points of the protocol, restart them, and
check that greedy output is what the fault-free run gave.

`skippy-zmq chaos --topology T --rounds N` (or scripts/chaos.sh) launches the
topology's stages and driver as real processes, computes each prompt's clean
output once, then plays every scenario N times and prints a table. Stages
die by SIGKILL: either their own, armed through a fault file
(skippy_zmq/stage/faults.py) to fire on the nth message of a kind, or the
tool's, at the nth streamed token. A dead stage is restarted with
`launch.restart_stage`, exactly as scripts/restart-stage.sh does.

Speculation is on in a run that plays a speculating scenario: the topology's
`driver.speculative`, or ngram with max_draft 8 in a copy of the topology
written to the run directory when it is off (stages then also compile verify
windows before READY: about 2 s more per restart on a 2-core CPU box). The
"copy" prompt, whose answer repeats the prompt, speculates: its clean output
must equal its speculation-off output (greedy identity), windows must have
run, and its spec-window scenarios kill a stage on the nth DECODE carrying a
verify window. Every other prompt opts out of drafting (the request's
`speculative: false`), so those scenarios count plain DECODEs as before.

A scenario sends one kind of request (KINDS): a plain streamed completion,
whose tokens drive the at_token faults, or one of the newer surfaces, answered
whole and killed on a message kind: a json_schema-constrained chat, a forced
tool call, n = 3 sampled choices (fixed seed) and logprobs with echo. Each
kind reads its answer into an Outcome; the faulted one must equal the
fault-free one field by field (logprobs within LOGPROB_TOL).

It is a tool, not a test; tests/test_chaos.py plays each scenario once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import yaml
from loguru import logger

from skippy_zmq.ops import launch
from skippy_zmq.devtools.chaos_requests import KINDS, REQUEST_TIMEOUT_S, Outcome, send
from skippy_zmq.stage import faults
from skippy_zmq.config.topology import Topology
from skippy_zmq.config.topology_yaml import load_topology
from skippy_zmq.protocol.wire import Kind

SHORT = "List the planets of the solar system and describe each one:"
SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps running to the sea. "
COPY_PROMPT = ("Repeat the following text exactly: The old lighthouse keeper climbed the stairs every evening to light "
        "the lamp. Ships passing in the night could see its beam from miles away. He kept a log of every ship "
        "he saw.\n\nThe old lighthouse keeper")
PLANET = "Describe the planet Mars in JSON."
WEATHER = "What is the weather like in Paris today?"
SPECULATING = ("copy",)    # the prompts whose requests draft; every other one opts out
SPECULATIVE = {"method": "ngram"}   # driver.speculative when the topology has it off
DEATH_TIMEOUT_S = 300.0    # bound on waiting for an armed stage to die (a busy machine reaches its nth message late)
WARM_TOKENS = 4            # the warm-up before a kind's fault-free run


@dataclass(frozen=True)
class Fault:
    stage: str                 # "first" | "middle" | "last"
    kind: Kind | None = None   # self-kill on the nth message of this kind (armed by file) ...
    nth: int = 1
    at_token: int = 0          # ... or the tool's SIGKILL once this many tokens have streamed
    window: bool = False       # count only messages carrying a verify window (a row of more than one token)


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt: str                # "short" | "long" | "restore" | "copy" | "planet" | "weather"
    faults: tuple[Fault, ...]  # played in order; a later fault on a stage hits its replacement
    kind: str = "plain"        # the request it sends: a key of KINDS


# (scenario prefix, request kind, prompt, the message a stage dies on, its count): DECODEs well inside
# each fault-free answer; n3-fork dies on the FORK_SESSION that copies choice 0's prompt KV to the others
SURFACES = (("json-schema", "json-schema", "planet", Kind.DECODE, 6),
            ("tool-call", "tool-call", "weather", Kind.DECODE, 8),
            ("n3", "n3", "short", Kind.DECODE, 12), ("n3-fork", "n3", "short", Kind.FORK_SESSION, 1),
            ("logprobs", "logprobs", "short", Kind.DECODE, 12))


def scenarios() -> list[Scenario]:
    out = []
    for where in ("first", "middle", "last"):
        out.append(Scenario(f"mid-stream/{where}", "short", (Fault(where, Kind.DECODE, 12),)))
        out.append(Scenario(f"prefill-chunk/{where}", "long", (Fault(where, Kind.PREFILL, 2),)))
        out.append(Scenario(f"restore/{where}", "restore", (Fault(where, Kind.TRY_RESTORE_PREFILL_DECODE, 1),)))
        out.append(Scenario(f"spec-window/{where}", "copy", (Fault(where, Kind.DECODE, 2, window=True),)))
    out.append(Scenario("two-at-once/first+last", "short", (Fault("first", at_token=12), Fault("last", at_token=12))))
    out.append(Scenario("same-twice/middle", "short", (Fault("middle", Kind.DECODE, 8), Fault("middle", Kind.DECODE, 8))))
    for prefix, kind, prompt, message, nth in SURFACES:   # answered whole: killed on a message, not a token
        for where in ("first", "middle", "last"):
            out.append(Scenario(f"{prefix}/{where}", prompt, (Fault(where, message, nth),), kind))
    return out


@dataclass
class Round:
    scenario: str
    identical: bool
    error: str = ""
    detect_s: float | None = None
    resume_s: float | None = None
    windows: int | None = None   # verify windows the request ran (speculating prompts only)


class ChaosRun:
    """A launched topology plus what a round needs: stage processes, clean outputs, the fault directory."""

    def __init__(self, topology_path: Path, run_dir: Path, timeout: float = 400.0, speculate: bool = True):
        self.run_dir, self.speculate = Path(run_dir), speculate
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.topology_path = speculating_topology(Path(topology_path), self.run_dir) if speculate else \
            Path(topology_path)
        self.topology: Topology = load_topology(self.topology_path)
        self.fault_dir = self.run_dir / "faults"
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.fault_dir.glob("*.json"):
            stale.unlink()
        os.environ[faults.ENV] = str(self.fault_dir)   # inherited by every stage we spawn or restart
        self.procs = {s.id: launch.spawn_stage(self.topology_path, s, self.run_dir)
                      for s in reversed(self.topology.stages)}
        self.driver = launch.spawn_driver(self.topology_path, self.run_dir)
        d = self.topology.driver
        self.base = f"http://{d.http_host}:{d.http_port}"
        try:
            self.start(timeout)
        except BaseException:
            self.close()
            raise

    def start(self, timeout: float) -> None:
        d = self.topology.driver
        self.wait_ready(timeout)
        chunk = d.prefill_chunk
        # "long" spans ~2.5 prefill chunks (~18 tokens a sentence); "restore" is long enough to be recorded.
        self.prompts = {"short": SHORT, "restore": SENTENCE * 8 + SHORT,
                        "long": SENTENCE * max(4, (5 * chunk) // (2 * 18))}
        if self.speculate:
            self.prompts["copy"] = COPY_PROMPT
        self.clean: dict[tuple[str, str], Outcome] = {}   # (prompt, kind) -> its fault-free outcome
        self.clean_windows: dict[str, int] = {}
        for name in list(self.prompts):   # the plain ones now; the other kinds' on first use
            before = self.metric("spec_windows_total") or 0
            outcome = self.fault_free(name)
            if name in SPECULATING:
                self.clean_windows[name] = int((self.metric("spec_windows_total") or 0) - before)
            if outcome.error:
                raise RuntimeError(f"the fault-free {name!r} run failed: {outcome.error}")
        self.prompts.update(planet=PLANET, weather=WEATHER)
        for name in [n for n in SPECULATING if n in self.prompts]:   # greedy identity: drafts change no token
            off = self.complete(self.prompts[name], f"clean-{name}-off", speculative=False)
            if off.error or off.text != self.clean[name, "plain"].text:
                raise RuntimeError(f"the {name!r} prompt's output with speculation on differs from off: "
                                   f"{self.clean[name, 'plain'].text!r} vs {off.error or off.text!r}")
            if not self.clean_windows[name]:
                raise RuntimeError(f"the {name!r} prompt ran no verify window: nothing was drafted")
        self.rounds_played = 0

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        launch.stop_processes([*self.procs.values(), self.driver])
        os.environ.pop(faults.ENV, None)

    def wait_ready(self, timeout: float = 120.0) -> None:
        launch.wait_http_ready(self.base, [*self.procs.values(), self.driver], self.run_dir, timeout)

    def stage_id(self, where: str) -> str:
        stages = self.topology.stages
        return {"first": stages[0], "middle": stages[len(stages) // 2], "last": stages[-1]}[where].id

    def fault_free(self, prompt: str, kind: str = "plain") -> Outcome:
        """The prompt's clean outcome for this kind of request (computed once; error set when it is
        unusable: failed, or not showing what the kind tests)."""
        if (prompt, kind) not in self.clean:
            namespace = f"clean-{prompt}" if kind == "plain" else f"clean-{prompt}-{kind}"
            if kind != "plain":   # first uses (the constraint engine's tokenizer, new shapes) can stall a
                # stage past dead_after on a busy box; a short request of the kind pays them beforehand
                self.complete(self.prompts[prompt], f"warm-{prompt}-{kind}", kind=kind, max_tokens=WARM_TOKENS)
            failures = self.failure_metrics()[0]
            out = self.complete(self.prompts[prompt], namespace, speculative=prompt in SPECULATING, kind=kind)
            if not out.error and self.failure_metrics()[0] != failures:   # e.g. heartbeats late on a busy box
                out.error = "the driver saw a stage failure during it: a resumed run is not a fault-free one"
            out.error = out.error or KINDS[kind].sane(out)
            self.clean[prompt, kind] = out
        return self.clean[prompt, kind]

    def complete(self, prompt: str, namespace: str, on_token: Callable[[int], None] | None = None,
                 speculative: bool = False, kind: str = "plain", max_tokens: int | None = None) -> Outcome:
        return send(self.base, KINDS[kind], prompt, namespace, on_token, speculative, max_tokens)

    def metric(self, name: str, text: str | None = None) -> float | None:
        text = text if text is not None else httpx.get(f"{self.base}/metrics", timeout=10).text
        m = re.search(rf"^skippy_{name} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else None

    def failure_metrics(self) -> tuple[int, float | None, float | None]:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return int(self.metric("stage_failures_total", text) or 0), \
            self.metric("last_failure_detect_seconds", text), self.metric("last_failure_resume_seconds", text)

    # ------------------------------------------------------------ one round

    def play(self, scenario: Scenario) -> Round:
        self.rounds_played += 1
        namespace = f"chaos-{self.rounds_played}"
        if scenario.prompt not in self.prompts:
            return Round(scenario.name, False, f"this run has no {scenario.prompt!r} prompt (speculate=False)")
        prompt = self.prompts[scenario.prompt]
        clean = self.fault_free(scenario.prompt, scenario.kind)
        if clean.error:
            return Round(scenario.name, False, f"the fault-free run is unusable: {clean.error}")
        if scenario.prompt == "restore":
            namespace = f"restore-{self.rounds_played}"
            warm = self.complete(prompt, namespace)   # every stage records the prompt; the next try restores it
            if warm.error:
                return Round(scenario.name, False, f"warm-up failed: {warm.error}")
        failures_before = self.failure_metrics()[0]
        speculating = scenario.prompt in SPECULATING
        windows_before = self.metric("spec_windows_total") or 0
        pending = list(scenario.faults)
        kills: dict[str, threading.Event] = {}
        for f in pending:
            if f.at_token:
                kills.setdefault(self.stage_id(f.stage), threading.Event())

        def on_token(n: int) -> None:
            for f in pending:
                if f.at_token == n:
                    sid = self.stage_id(f.stage)
                    os.kill(self.procs[sid].pid, signal.SIGKILL)
                    kills[sid].set()

        result: list[Outcome] = []
        first = pending[0]
        if first.kind is not None:
            faults.arm(self.fault_dir, self.stage_id(first.stage), first.kind, first.nth, first.window)
        request = threading.Thread(target=lambda: result.append(
            self.complete(prompt, namespace, on_token, speculative=speculating, kind=scenario.kind)))
        request.start()
        error = self.reap_and_restart(scenario, request)
        request.join(REQUEST_TIMEOUT_S)
        outcome = result[0] if result else Outcome(error="the request did not finish")
        count, detect, resume = self.failure_metrics()
        windows = int((self.metric("spec_windows_total") or 0) - windows_before) if speculating else None
        if not error and count <= failures_before:
            error = "the driver saw no stage failure"
        error = error or outcome.error
        if not error and windows == 0:
            error = "no verify window ran"
        differs = "" if error else outcome.differs(clean)
        if differs:
            error = f"output differs from the fault-free run: {differs}"
        identical = not error
        self.wait_ready()
        return Round(scenario.name, identical, error, detect if count > failures_before else None,
                     resume if count > failures_before else None, windows)

    def reap_and_restart(self, scenario: Scenario, request: threading.Thread) -> str:
        """Wait for each planned death (bounded), restart the stage, arm the next fault if any."""
        faults_left = list(scenario.faults)
        while faults_left:
            f = faults_left.pop(0)
            sid = self.stage_id(f.stage)
            proc = self.procs[sid]
            deadline = time.monotonic() + DEATH_TIMEOUT_S
            while proc.poll() is None:
                if not request.is_alive() or time.monotonic() > deadline:
                    (self.fault_dir / f"{sid}.json").unlink(missing_ok=True)
                    what = f"{f.kind.name}{' window' if f.window else ''}" if f.kind else "token"
                    return f"stage {sid} was never killed ({what} fault did not fire)"
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            together = [g for g in faults_left if g.at_token and f.at_token]
            for g in [f, *together]:   # stages killed at the same token come back together
                gid = self.stage_id(g.stage)
                self.procs[gid].wait(timeout=DEATH_TIMEOUT_S)
                self.procs[gid] = launch.restart_stage(self.run_dir, gid)
            faults_left = [g for g in faults_left if g not in together]
            if faults_left and faults_left[0].kind is not None:
                nxt = faults_left[0]
                faults.arm(self.fault_dir, self.stage_id(nxt.stage), nxt.kind, nxt.nth, nxt.window)
        return ""


def speculating_topology(path: Path, run_dir: Path) -> Path:
    """`path` if its driver speculates, else a copy in `run_dir` with driver.speculative = SPECULATIVE."""
    if load_topology(path).driver.speculative.enabled:
        return path
    raw = yaml.safe_load(path.read_text())
    raw.setdefault("driver", {})["speculative"] = dict(SPECULATIVE)
    out = run_dir / f"{path.stem}-speculative.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    load_topology(out)   # validate
    return out


# ---------------------------------------------------------------- the table


def summarize(rounds: list[Round]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r.scenario for r in rounds):
        mine = [r for r in rounds if r.scenario == name]
        detect = [r.detect_s for r in mine if r.detect_s is not None]
        resume = [r.resume_s for r in mine if r.resume_s is not None]
        windows = [r.windows for r in mine if r.windows is not None]
        rows.append({"scenario": name, "rounds": len(mine), "identical": sum(r.identical for r in mine),
                     "errors": sum(bool(r.error) for r in mine),
                     "median_detect_s": round(statistics.median(detect), 2) if detect else None,
                     "median_resume_s": round(statistics.median(resume), 2) if resume else None,
                     "median_windows": statistics.median(windows) if windows else None})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| scenario | rounds | identical | errors | median detect (s) | median resume (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['rounds']} | {r['identical']} | {r['errors']} | "
                     f"{r['median_detect_s']} | {r['median_resume_s']} |")
    return "\n".join(lines)


def run(topology_path: Path, rounds: int, run_dir: Path, only: list[str] | None = None) -> list[Round]:
    chosen = [s for s in scenarios() if not only or any(s.name.startswith(o) for o in only)]
    if any(st.cache.mode == "disabled" for st in load_topology(topology_path).stages):
        logger.warning("the prefix cache is disabled on some stage: skipping the restore scenarios")
        chosen = [s for s in chosen if s.prompt != "restore"]
    chaos = ChaosRun(topology_path, run_dir, speculate=any(s.prompt in SPECULATING for s in chosen))
    played: list[Round] = []
    try:
        for i in range(rounds):
            for scenario in chosen:
                r = chaos.play(scenario)
                played.append(r)
                logger.info("round {} {}: {}{}", i + 1, r.scenario, "identical" if r.identical else "FAILED",
                            f" ({r.error})" if r.error else "")
    finally:
        chaos.close()
    return played


def main(topology: str, rounds: int, out: str, only: list[str] | None = None) -> int:
    run_dir = Path(out) / "run"
    played = run(Path(topology), rounds, run_dir, only)
    rows = summarize(played)
    table = markdown(rows)
    print(table)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "chaos.json").write_text(json.dumps({"topology": topology, "rounds": rounds, "summary": rows,
                                                      "rounds_detail": [r.__dict__ for r in played]}, indent=2))
    (Path(out) / "chaos.md").write_text(table + "\n")
    return 0 if all(r.identical for r in played) else 1
