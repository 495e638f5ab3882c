"""llama.cpp's own server test suite against our server.

    python scripts/llama_server_tests.py [--json out.json] [unit/test_x.py ...]

The llama-cpp-python sdist (skippy_zmq.devtools.bench.llama_build.sdist: pip from PyPI once, then cached) vendors
llama.cpp with `tools/server/tests/`; only that folder is unpacked, into a cache folder named by the
sdist's sha256. A real 1-stage SmolLM2 pipeline starts once; scripts/llama_server_shim.py makes their
`ServerProcess.start()` serve our app over it (with the test's api_key and model alias), and skips
the tests in its SKIPS with their reasons. Prints passed / failed / skipped per file, the failures and
the skips with their reasons, and writes the same as JSON. Exit status: 1 when a test failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server_shim import ShimPlugin  # noqa: E402  (the shim sits beside this script)

from skippy_zmq.devtools.bench import llama_build  # noqa: E402
from skippy_zmq.api.server import create_app, start_in_thread  # noqa: E402
from skippy_zmq.devtools.harness import running_pipeline, write_topology  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
TESTS_IN_SDIST = f"llama_cpp_python-{llama_build.SDIST_VERSION}/vendor/llama.cpp/tools/server/tests/"
# The files for the endpoints we share with llama-server: OpenAI chat / completions, Anthropic
# messages, OpenAI responses, CORS and API keys.
DEFAULT_FILES = ("unit/test_chat_completion.py", "unit/test_completion.py", "unit/test_compat_anthropic.py",
                 "unit/test_compat_oai_responses.py", "unit/test_security.py")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def server_tests(archive: Path, cache: Path) -> Path:
    """tools/server/tests of the sdist, unpacked once into cache/server-tests-<sha256> (data filter)."""
    target = cache / f"server-tests-{sha256(archive)[:16]}"
    if (target / "utils.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".server-tests-"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(TESTS_IN_SDIST)]
        for member in members:
            member.name = member.name.removeprefix(TESTS_IN_SDIST)
        tar.extractall(staging, members=[m for m in members if m.name], filter="data")
    if not (staging / "utils.py").is_file():
        shutil.rmtree(staging)
        raise SystemExit(f"{archive} has no {TESTS_IN_SDIST}utils.py")
    try:
        staging.rename(target)
    except OSError:               # another run unpacked it first
        shutil.rmtree(staging)
    return target


# What a first request of a kind costs once (the chat template, the grammar engine's tokenizer, the
# first schema compile, the sampler's shapes) is paid here, before their tests, whose clients and
# the 10 s submit deadline would otherwise meet it on a loaded machine.
WARM_UP = ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
           {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
           {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2},
           {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_object"}})


def warm_up(engine: Any, tokenizer: Any, deadline_s: float = 300.0) -> None:
    """Each WARM_UP request once through our app, retried while the driver answers 503 (busy warming)."""
    handle = start_in_thread(create_app(engine, tokenizer))
    try:
        with httpx.Client(base_url=handle.url, timeout=deadline_s) as client:
            for body in WARM_UP:
                t0 = time.monotonic()
                while (status := client.post("/v1/chat/completions", json=body).status_code) == 503:
                    if time.monotonic() - t0 > deadline_s:
                        raise SystemExit(f"warm-up request still answered 503 after {deadline_s:g} s")
                if status != 200:
                    raise SystemExit(f"warm-up request {body} answered {status}")
    finally:
        handle.stop()


# The context our pipeline serves: llama-server's test preset's (tinyllama2: n_ctx 512). Their prompts are
# far shorter; a longer max_tokens is clamped to the room left, as the server clamps every request. A
# stage compiles its prefill and decode shapes at each attention length up to it before READY, so 512
# (two lengths) instead of the shipped 2048 (four) took the pipeline's start and warm-up from 139 s to
# 60 s (CPU 149 -> 105 s for the whole run) on the loaded 2-core machine, with the same outcomes.
MAX_CONTEXT = 512


def run_suite(tests_dir: Path, files: list[str], run_dir: Path, max_context: int = MAX_CONTEXT) -> ShimPlugin:
    """Their tests, in this process, against a 1-stage SmolLM2 pipeline."""
    # No idle warm-ups, and no wait for them: a shape not compiled before READY runs layer by layer
    # (the stop-gap steps, compiled before READY) while its whole-slice step compiles behind, in the
    # stage's child, so no request of theirs waits on a compile either way; waiting for every idle
    # warm-up (as this did) cost 86.5 CPU s for the run with empty caches against 60.1 without (wall 71
    # -> 48 s; warm caches 57 -> 50 CPU s, 53 -> 43 s), the same 46 passed (2-core Zen 4, quiet).
    topology = write_topology(run_dir, MODEL_DIR, 1, name="llama-server-tests", driver__max_context=max_context,
                              idle_warmups=False)
    with running_pipeline(topology, run_dir / "run", timeout=600) as (engine, tokenizer, _, _):
        warm_up(engine, tokenizer)
        plugin = ShimPlugin(engine, tokenizer, tests_dir)
        cwd = os.getcwd()
        os.chdir(tests_dir)       # their tests name files relative to their folder
        try:
            pytest.main([*files, "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
                         "--rootdir", str(tests_dir), "-c", str(tests_dir / "pytest.ini"), "-W", "ignore"],
                        plugins=[plugin])
        finally:
            os.chdir(cwd)
    return plugin


def summary(plugin: ShimPlugin) -> dict:
    per_file: dict[str, Counter] = {}
    for o in plugin.outcomes.values():
        per_file.setdefault(o.nodeid.split("::", 1)[0], Counter())[o.outcome] += 1
    return {"sdist": llama_build.SDIST_VERSION,
            "files": {f: {k: c[k] for k in ("passed", "failed", "skipped")} for f, c in sorted(per_file.items())},
            "tests": [vars(o) for o in plugin.outcomes.values()]}


def print_table(result: dict) -> None:
    print(f"\nllama.cpp server tests (llama-cpp-python {result['sdist']} sdist) against skippy_zmq")
    print(f"| {'file':<36} | passed | failed | skipped |\n|{'-' * 38}|--------|--------|---------|")
    totals = Counter()
    for name, counts in result["files"].items():
        totals.update(counts)
        print(f"| {name:<36} | {counts['passed']:>6} | {counts['failed']:>6} | {counts['skipped']:>7} |")
    print(f"| {'total':<36} | {totals['passed']:>6} | {totals['failed']:>6} | {totals['skipped']:>7} |")
    for kind in ("passed", "failed", "skipped"):
        rows = [t for t in result["tests"] if t["outcome"] == kind and t["reason"]]
        if rows:
            print(f"\n{kind} ({'with a reason' if kind == 'passed' else 'with the reason'}):")
            for t in rows:
                print(f"  {t['nodeid']}: {t['reason']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", default=list(DEFAULT_FILES), help="their test files (unit/test_x.py)")
    ap.add_argument("--json", type=Path, help="write the outcomes here")
    ap.add_argument("--max-context", type=int, default=MAX_CONTEXT, help="the pipeline's context (tokens)")
    args = ap.parse_args(argv)
    tests_dir = server_tests(llama_build.sdist(), llama_build.cache_dir())
    with tempfile.TemporaryDirectory(prefix="llama-server-tests-") as tmp:
        plugin = run_suite(tests_dir, args.files, Path(tmp), args.max_context)
    result = summary(plugin)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(t["outcome"] == "failed" for t in result["tests"]) or not result["tests"] else 0


if __name__ == "__main__":
    sys.exit(main())
