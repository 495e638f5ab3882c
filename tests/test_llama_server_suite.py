"""llama.cpp's own server tests (the llama-cpp-python sdist's tools/server/tests) for the endpoints we
share with llama-server, run against our server by scripts/llama_server_tests.py: none may fail, and
every test left out must be one that scripts/llama_server_shim.py's SKIPS names with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.devtools.bench import llama_build

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from llama_server_shim import skip_reason  # noqa: E402
from llama_server_tests import DEFAULT_FILES  # noqa: E402


@pytest.fixture(scope="module")
def sdist() -> Path:
    try:
        return llama_build.sdist()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"the llama-cpp-python {llama_build.SDIST_VERSION} sdist cannot be had here "
                    f"(pip download failed: {exc}); put it in {llama_build.cache_dir() / 'sdist'}")


def test_llama_server_suite_passes_on_our_server(sdist, model_dir, tmp_path):
    out = tmp_path / "llama_server_tests.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "llama_server_tests.py"), "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=2400)
    table = run.stdout[run.stdout.find("llama.cpp server tests"):]
    print(table)   # the counts and every skip's reason, for `pytest -s` and CI logs
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["files"]) == set(DEFAULT_FILES), table
    failed = [t["nodeid"] for t in result["tests"] if t["outcome"] == "failed"]
    assert failed == [], table
    unlisted = [t["nodeid"] for t in result["tests"] if t["outcome"] == "skipped" and not skip_reason(t["nodeid"])]
    assert unlisted == [], f"skipped without a SKIPS entry: {unlisted}"
    passed = sum(c["passed"] for c in result["files"].values())
    assert passed >= 30, table
    assert run.returncode == 0, table
