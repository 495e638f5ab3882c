"""The console at `/`: its static files (types, security headers, nothing from outside), the
status JSON (a local engine; a PipelineEngine fed real READY / heartbeat / token replies over
ZeroMQ; the real 2-stage SmolLM2 pipeline), and one run in headless Chromium against that
pipeline with an API key: load, key, chat streams, stage table, screenshot ($SKIPPY_CONSOLE_SCREENSHOT, e.g. docs/console.png)."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest
from fake_engine import FakeEngine

from skippy_zmq.protocol import transport, wire
from skippy_zmq.api import console
from skippy_zmq.api.console_status import RateWindow
from skippy_zmq.api.main import build_app
from skippy_zmq.engine.pipeline import PipelineEngine
from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.devtools.harness import write_topology
from skippy_zmq.text.tokenizer import TextTokenizer
from skippy_zmq.config.topology_yaml import load_topology

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
SCREENSHOT_ENV = "SKIPPY_CONSOLE_SCREENSHOT"   # a path: where the browser test saves its screenshot (docs/console.png
                                             # to refresh the README's); default: the test's temporary folder
API_KEY = "console-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ASSET_DIR = resources.files("skippy_zmq.api").joinpath(console.ASSET_DIR)
SVG_NAMESPACE = "http://www.w3.org/2000/svg"   # an XML namespace name (never fetched): the one URL allowed
MARKDOWN = ("Hi **bold** and *it*, `x<y` and snake_case_name.\n\n- one\n- two\n\n"
            "```py\nprint('<b>')\n```\n<img src=x onerror=alert(1)>")
MARKDOWN_DOM = ("<p>Hi <strong>bold</strong> and <em>it</em>, <code>x&lt;y</code> and snake_case_name.</p>"
                "<ul><li>one</li><li>two</li></ul><pre><code data-lang=\"py\">print('&lt;b&gt;')</code></pre>"
                "<p>&lt;img src=x onerror=alert(1)&gt;</p>")
INSTALL_HINT = ("no headless browser: install Debian's chromium and chromium-driver "
                "(apt-get install -y chromium chromium-driver; .ci/run does it) to run the console's browser test")


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.load(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def locked(tok):
    """A scripted engine behind an API key."""
    engine = FakeEngine([*tok.encode("Hi **there**."), tok.eos_ids[0]], tok.eos_ids, model_name="scripted")
    handle = start_in_thread(create_app(engine, tok, model_name="scripted", api_key=API_KEY))
    yield handle
    handle.stop()


# ---------------------------------------------------------------- static files

def test_every_asset_is_served_with_its_type_and_the_security_headers(locked):
    shipped = sorted(p.name for p in ASSET_DIR.iterdir())
    assert sorted(name for name, _ in console.ASSETS.values()) == shipped   # nothing shipped unserved
    for path, (name, content_type) in console.ASSETS.items():
        response = httpx.get(locked.url + path, timeout=10)   # no key: the page and its files hold no data
        assert response.status_code == 200, path
        assert response.headers["content-type"] == content_type
        assert response.content == ASSET_DIR.joinpath(name).read_bytes()
        assert response.headers["content-security-policy"] == console.CONTENT_SECURITY_POLICY
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
    csp = dict(part.strip().split(" ", 1) for part in console.CONTENT_SECURITY_POLICY.split(";"))
    assert csp["default-src"] == csp["script-src"] == csp["connect-src"] == "'self'"
    assert csp["frame-ancestors"] == csp["object-src"] == csp["base-uri"] == "'none'"


def test_no_asset_points_outside_the_server():
    for path in ASSET_DIR.iterdir():
        text = path.read_text().replace(SVG_NAMESPACE, "")
        for outside in ("http://", "https://", "//cdn", "@import"):
            assert outside not in text, f"{path.name} refers to {outside!r}"
        assert not re.search(r"url\(\s*['\"]?(?!#)", text), path.name   # url(#arrow): in-document only
        assert not re.search(r"""(src|href)\s*=\s*["'](?!/console/)""", text), path.name


def test_the_page_runs_no_inline_script_and_never_writes_html():
    page = ASSET_DIR.joinpath("index.html").read_text()
    assert re.findall(r"<script[^>]*>", page) == [f'<script src="/console/{name}" defer>'
                                                   for name in ("markdown.js", "pipeline.js", "console.js")]
    assert not re.search(r"\son\w+\s*=|\sstyle\s*=|<style", page)   # no inline handlers or styles (CSP)
    for name in ("console.js", "markdown.js", "pipeline.js"):
        script = ASSET_DIR.joinpath(name).read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in script, f"{name} uses {sink}"


def test_package_data_ships_the_assets():
    setup = (REPO_ROOT / "setup.cfg").read_text()
    line = re.search(r"^skippy_zmq\.api = (.*)$", setup, re.M).group(1)
    globs = [g.strip().removeprefix(f"{console.ASSET_DIR}/") for g in line.split(",")]
    assert all(any(Path(name).match(g) for g in globs) for name, _ in console.ASSETS.values())


# ---------------------------------------------------------------- status JSON

def test_status_is_behind_the_key_and_shows_a_local_engine_as_one_stage(locked):
    bare = httpx.get(locked.url + console.STATUS_ENDPOINT, timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(locked.url + console.STATUS_ENDPOINT, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    response = httpx.get(locked.url + console.STATUS_ENDPOINT, headers=AUTH, timeout=10)
    assert response.status_code == 200 and response.headers["x-content-type-options"] == "nosniff"
    status = response.json()
    assert (status["model"], status["ready"], status["hops"]) == ("scripted", True, [])
    [stage] = status["stages"]
    assert (stage["id"], stage["up"], stage["host"], stage["layers"], stage["step_ms"]) == ("local", True, None, None,
                                                                                            None)
    assert set(stage["memory"].values()) == {None}   # nothing is known, nothing is made up
    assert status["driver"]["queued"] is None and status["driver"]["running"] == 0


def test_rate_window_needs_half_a_second_and_restarts_when_a_counter_goes_down():
    rate = RateWindow()
    assert rate.rate() is None
    rate.add(100.0, 10)
    rate.add(100.2, 30)
    assert rate.rate() is None                 # too short a span to call it a rate
    rate.add(101.0, 110)
    assert rate.rate() == pytest.approx(100.0)
    rate.add(108.0, 810)                       # samples older than the window drop out
    rate.add(109.0, 910)
    assert rate.rate() == pytest.approx(100.0)
    rate.add(109.5, 5)                         # a replacement stage counts from zero again
    assert rate.rate() is None


def _stage_info(weights: int, tokens: int) -> dict:
    """A heartbeat's info as StageWorker.status() writes it (a subset)."""
    return {"state": "serving", "lanes_in_use": 1, "lanes": 8, "messages": 9, "errors": 0, "tokens": tokens,
            "weight_bytes": weights, "kv_bytes": 4096, "predicted_bytes": 3 * weights, "memory_budget_bytes": 0,
            "rss_bytes": 2 * weights, "warmups_pending": 0, "cache_hits": 3, "cache_misses": 1,
            "cache_bytes": 512, "cache_entries": 2}


@pytest.fixture
def fed_pipeline(tmp_path, tok):
    """A real PipelineEngine and its app on a 2-stage topology whose stages are test sockets: READY,
    one heartbeat each and one decode step's reply with a trace, sent over ZeroMQ."""
    # The stages here are test sockets without keys: the console reads replies, the wire's checks are
    # tests/test_wire_attacks.py's.
    topology = load_topology(write_topology(tmp_path, tmp_path / "model", 2, n_layers=6, security="none",
                                            driver__dead_after_s=600.0))
    engine = PipelineEngine(topology, tok.eos_ids, model_name="fed").start()
    handle = start_in_thread(build_app(topology, engine, tok, api_key=API_KEY))
    seen = threading.Event()   # after the console's hook: set once the trace is in
    engine.on_reply_hooks.append(lambda sid, msg: msg.kind == wire.Kind.PREDICTED_TOKENS and seen.set())
    socks = {s.id: transport.open_heartbeat_socket(transport.context(), topology.driver.return_connect, s.id)
             for s in topology.stages}
    try:
        for i, (sid, sock) in enumerate(socks.items()):
            transport.send_message(sock, wire.Message.ready(sid, 7, _stage_info(1000 * (i + 1), 0)))
        assert engine.wait_ready(30), engine.not_ready_reason()
        for i, (sid, sock) in enumerate(socks.items()):
            transport.send_message(sock, wire.Message.heartbeat(sid, 7, _stage_info(1000 * (i + 1), 40)))
        t = time.time_ns() - 50_000_000   # s1 sent its token 41 ms before this test sends it on
        trace = [{"stage": "s0", "compute_ms": 2.5, "rows": 1, "recv_ns": t, "send_ns": t + 3_000_000},
                 {"stage": "s1", "compute_ms": 4.0, "rows": 1, "recv_ns": t + 4_500_000, "send_ns": t + 9_000_000}]
        transport.send_message(socks["s1"], wire.Message.predicted_tokens(1, [1], [5], {"trace": trace}))
        assert seen.wait(30)
        yield handle
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        handle.stop()
        engine.close()


def test_status_of_a_pipeline_from_its_replies(fed_pipeline):
    status = httpx.get(fed_pipeline.url + console.STATUS_ENDPOINT, headers=AUTH, timeout=10).json()
    assert [s["id"] for s in status["stages"]] == ["s0", "s1"]
    s0, s1 = status["stages"]
    assert (s0["layers"], s1["layers"], s0["host"], s0["device"]) == ([0, 3], [3, 6], "127.0.0.1", "cpu")
    assert s1["memory"] == {"weights": 2000, "kv": 4096, "cache": 512, "rss": 4000, "plan": 6000, "budget": None}
    assert (s0["step_ms"], s1["step_ms"]) == (2.5, 4.0)
    assert (s0["lanes_in_use"], s0["lanes"], s0["cache"]["hit_rate"], s0["up"]) == (1, 8, 0.75, True)
    assert s0["tokens_per_s"] is None   # two heartbeats moments apart: no rate yet, and none made up
    hops = status["hops"]
    assert [(h["from"], h["to"]) for h in hops] == [("driver", "s0"), ("s0", "s1"), ("s1", "driver")]
    assert hops[0]["ms"] is None and hops[1]["ms"] == 1.5   # the driver stamps no send time: not known
    assert hops[2]["ms"] >= 41.0   # the driver's receive wall clock minus s1's send
    driver = status["driver"]
    assert (driver["running"], driver["queued"], driver["speculation"]["enabled"]) == (0, 0, False)
    assert driver["speculation"]["acceptance"] is None and driver["prefix_cache"]["hit_rate"] is None
    assert status["ready"] and status["model"] == "fed"


# ---------------------------------------------------------------- the real pipeline

@pytest.fixture
def served(shared_pipelines):
    """The session's 2-stage pipeline (function scope: the browser test's skip comes before its start)."""
    return shared_pipelines(2)


@pytest.mark.slow
def test_status_of_the_real_pipeline(served):
    response = httpx.post(served.url + "/v1/chat/completions", timeout=300, json={
        "model": "m", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "Hi!"}]})
    assert response.status_code == 200
    status = httpx.get(served.url + console.STATUS_ENDPOINT, timeout=30).json()
    stages = {s["id"]: s for s in status["stages"]}
    assert list(stages) == [s.id for s in served.topology.stages]
    for cfg in served.topology.stages:
        row = stages[cfg.id]
        assert (row["layers"], row["host"], row["device"], row["up"]) == ([cfg.start, cfg.end], cfg.host, cfg.device,
                                                                         True)
        assert row["memory"]["weights"] > 0 and row["memory"]["kv"] > 0 and row["memory"]["rss"] > 0
        assert row["step_ms"] > 0 and row["lanes"] == cfg.kv_lanes
    assert [h["ms"] is None for h in status["hops"]] == [True, False, False]
    assert status["driver"]["speculation"]["enabled"] is True


@pytest.fixture
def browser():
    """Headless Chromium through chromedriver (Debian's packages), viewport 1200x800."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip(INSTALL_HINT)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,800", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def keyed(served):
    """A second HTTP server, with an API key, in front of the shared pipeline (its hooks removed after)."""
    engine = served.engine
    hooks = len(engine.on_reply_hooks)
    handle = start_in_thread(build_app(served.topology, engine, served.tokenizer, api_key=API_KEY))
    yield handle.url
    handle.stop()
    done = threading.Event()

    def unhook() -> None:   # on the pipeline thread, which runs the hooks
        del engine.on_reply_hooks[hooks:]
        done.set()
    engine.call(unhook)
    assert done.wait(30)


@pytest.mark.slow
def test_console_in_a_browser(browser, keyed, served, tmp_path):
    from console_page import ConsolePage

    page = ConsolePage(browser, keyed)
    page.open()
    assert page.render_markdown(MARKDOWN) == MARKDOWN_DOM   # model text becomes text nodes, never markup
    assert "401" in page.auth_message() and "API key" in page.auth_message()   # no key: told, nothing shown
    page.use_key(API_KEY)
    rows = page.stage_rows({s.id for s in served.topology.stages})
    for cfg in served.topology.stages:
        assert rows[cfg.id]["layers"] == f"{cfg.start}–{cfg.end - 1}"
        assert (rows[cfg.id]["host"], rows[cfg.id]["device"]) == (cfg.host, cfg.device)
    page.set_sampling(temperature=0, max_tokens=400, seed=7)
    stopped = page.chat("Count from 1 to 500, one number per line.", stop_after_text=True)
    # Stopped once text showed; the rendered text may be empty afterwards ("1." renders as an empty
    # ordered-list item), so what counts is that some text was seen before the stop.
    assert stopped.state == "stopped" and any(stopped.observed), stopped
    page.new_chat()
    page.set_sampling(temperature=0, max_tokens=96, seed=7)
    answer = page.chat("Give three short tips for writing clear Python code, as a bulleted list.")
    assert answer.state == "done" and answer.text.strip(), answer
    assert len(answer.repaints) >= 3 and answer.repaints[-1] == len(answer.text) > answer.repaints[0]
    assert answer.observed[-1] == len(answer.text) and any(0 < n < len(answer.text) for n in answer.observed)
    assert re.search(r"\b(stop|length) · \d+ tokens", answer.meta), answer.meta
    live = page.live_stage_rows({s.id for s in served.topology.stages})   # the table moves on: polled live
    assert all(float(row["step"]) > 0 for row in live.values()), live
    assert page.hop_labels()[1:] and all(label.endswith(" ms") for label in page.hop_labels()[1:])
    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "console.png")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(screenshot)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.console_errors() == []
