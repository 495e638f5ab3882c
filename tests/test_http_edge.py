"""The HTTP edge under attack (issue 38, "HTTP edges"): each attack replayed against the real
server on uvicorn (FakeEngine, real tokenizer) and refused with its status and message; CORS
and X-Api-Key (issue 42); slow headers and bodies cut off; connection caps. Key sources, the
topology's `driver.http_edge` and the driver process: test_http_edge_config.py."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from fake_engine import FakeEngine
from test_server import MESSAGES, MODEL, REPLY, _load_tokenizer

from skippy_zmq.config.http import EdgeConfig
from skippy_zmq.api.http_guard import ApiKeys
from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.text.tokenizer import TextTokenizer

API_KEY = "edge-key-1"
METRICS_KEY = "scrape-key-2"
APP_ORIGIN = "http://app.example:3000"
EDGE = EdgeConfig(allowed_origins=(APP_ORIGIN,), header_timeout_s=1.0, body_timeout_s=1.0,
                  max_connections=6, max_connections_per_client=3, max_header_bytes=8192)
LIVENESS_S = 3.0   # a cut-off or an answer must come within the deadline plus this


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return _load_tokenizer()


@pytest.fixture(scope="module")
def engine(tok: TextTokenizer) -> FakeEngine:
    return FakeEngine([*tok.encode(REPLY), tok.eos_ids[0]], tok.eos_ids, model_name="engine-name", max_context=256)


@pytest.fixture(autouse=True)
def fresh_engine(engine: FakeEngine) -> FakeEngine:
    engine.reset()
    return engine


@pytest.fixture(scope="module")
def server(engine, tok):
    app = create_app(engine, tok, model_name=MODEL, keys=ApiKeys.of(API_KEY, METRICS_KEY), edge=EDGE)
    handle = start_in_thread(app)
    yield handle
    handle.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=10, headers={"x-api-key": API_KEY}) as session:
        yield session


def _error(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def _chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}


# ---------------------------------------------------------------- keys

def test_key_covers_v1_and_metrics_but_not_probes(server):
    url = server.url
    for path in ("/v1/models", "/metrics", "/nowhere"):
        denied = httpx.get(f"{url}{path}")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert denied.headers["www-authenticate"] == "Bearer"
    for path in ("/health", "/readyz"):
        assert httpx.get(f"{url}{path}").status_code == 200
    for headers in ({"authorization": f"Bearer {API_KEY}"}, {"x-api-key": API_KEY},
                    {"Authorization": f"bearer {API_KEY}"}):
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200
    metrics_only = {"authorization": f"Bearer {METRICS_KEY}"}
    assert httpx.get(f"{url}/metrics", headers=metrics_only).status_code == 200   # the scraper's key
    assert httpx.get(f"{url}/v1/models", headers=metrics_only).status_code == 401  # opens nothing else
    assert httpx.get(f"{url}/metrics", headers={"x-api-key": API_KEY}).status_code == 200


def test_non_ascii_authorization_is_401_not_500(server):
    for value in (b"Bearer \xff\xfe\xfd", "Bearer schlüssel".encode("latin-1"), b"\xc3\xa9"):
        for name in ("authorization", "x-api-key"):
            resp = httpx.get(f"{server.url}/v1/models", headers={name: value})
            assert resp.status_code == 401 and "invalid or missing API key" in _error(resp)


def test_metrics_public_leaves_the_api_locked(engine, tok):
    app = create_app(engine, tok, model_name=MODEL, api_key=API_KEY, edge=EdgeConfig(metrics_public=True))
    handle = start_in_thread(app)
    try:
        assert httpx.get(f"{handle.url}/metrics").status_code == 200
        assert httpx.get(f"{handle.url}/v1/models").status_code == 401
    finally:
        handle.stop()


# ---------------------------------------------------------------- Host and Origin

def test_foreign_host_is_refused_dns_rebinding(http, server):
    port = server.port
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "", "a:b:c", "[::1"):
        resp = http.get("/v1/models", headers={"host": host})
        assert resp.status_code == 421, host
        assert "is not served here" in _error(resp) and "--allowed-hosts" in _error(resp)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST:{port}"):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_list_and_wildcard(engine, tok):
    for hosts, good, bad in ((("api.example", "box:9"), ["api.example:1234", "box:9"], ["box:10", "127.0.0.1"]),
                             (("*",), ["anything.example:1"], [])):
        handle = start_in_thread(create_app(engine, tok, model_name=MODEL, edge=EdgeConfig(allowed_hosts=hosts)))
        try:
            for host in good:
                assert httpx.get(f"{handle.url}/health", headers={"host": host}).status_code == 200, host
            for host in bad:
                assert httpx.get(f"{handle.url}/health", headers={"host": host}).status_code == 421, host
        finally:
            handle.stop()


def test_cross_origin_post_without_preflight_is_refused(http, server):
    # A page on another origin POSTs text/plain (a "simple" request: no preflight, the browser sends it).
    for headers in ({"origin": "http://evil.example", "content-type": "text/plain"},
                    {"origin": "null", "content-type": "application/json"}):
        resp = http.post("/v1/chat/completions", content=json.dumps(_chat_body()), headers=headers)
        assert resp.status_code == 403 and "is not allowed (--allowed-origins)" in _error(resp)
        assert "access-control-allow-origin" not in resp.headers
    same = http.post("/v1/chat/completions", json=_chat_body(), headers={"origin": server.url})  # same origin
    assert same.status_code == 200 and "access-control-allow-origin" not in same.headers


def test_cors_preflight_before_the_key_and_allow_origin_on_responses(server):
    asked = {"origin": APP_ORIGIN, "access-control-request-method": "POST",
             "access-control-request-headers": "content-type, x-api-key"}
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers=asked)   # no key: preflights never carry one
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "content-type, x-api-key"
    assert pre.headers["access-control-max-age"] == "600" and pre.headers["vary"] == "Origin"
    evil = httpx.options(f"{server.url}/v1/chat/completions", headers={**asked, "origin": "http://evil.example"})
    assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=_chat_body(max_tokens=100),
                      headers={"origin": APP_ORIGIN, "x-api-key": API_KEY})
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == REPLY
    assert resp.headers["access-control-allow-origin"] == APP_ORIGIN
    denied = httpx.post(f"{server.url}/v1/chat/completions", json=_chat_body(), headers={"origin": APP_ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == APP_ORIGIN  # readable


# ---------------------------------------------------------------- bodies

def test_post_must_declare_json(http):
    body = json.dumps(_chat_body()).encode()
    for content_type, got in (("text/plain", "got 'text/plain'"), ("application/x-www-form-urlencoded", "got"),
                              ("multipart/form-data; boundary=x", "got 'multipart/form-data'"),
                              (None, "none was given")):
        headers = {"content-type": content_type} if content_type else {}
        resp = http.post("/v1/chat/completions", content=body, headers=headers)
        assert resp.status_code == 415 and "Content-Type must be application/json" in _error(resp), content_type
        assert got in _error(resp)
    ok = http.post("/v1/chat/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("raw, says", [
    (b'{"messages": [', "malformed JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"a string"', "must be a JSON object"),
    (b"12", "must be a JSON object"),
    (b"\xff\xfe{}", "malformed JSON"),                      # not UTF-8
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),  # the parser's recursion
    (b'{"a": ' + b"9" * 10_000 + b"}", "malformed JSON"),    # past Python's int digit limit
])
def test_malformed_bodies_are_400_with_a_reason(http, raw, says):
    resp = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and says in _error(resp)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "1e999999"), ("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "-Infinity"),
    ("n", "1e400"), ("max_tokens", "-1"),
])
def test_hostile_numbers_are_4xx(http, field, value):
    raw = json.dumps(_chat_body()).encode()[:-1] + f', "{field}": {value}}}'.encode()
    resp = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500, (field, value, resp.text)
    assert field in _error(resp) or "JSON" in _error(resp)


# ---------------------------------------------------------------- slow clients and connection caps

def _connect(server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))
    return sock


def _dribble(sock: socket.socket, chunks: list[bytes], every_s: float) -> tuple[bytes, float]:
    """Send one chunk per `every_s` until the server speaks or hangs up; return all it said (up to
    its hang-up, which must come within LIVENESS_S) and the seconds it took. The pause between
    chunks is the attack (a slow client), not a sync."""
    start = time.monotonic()
    for chunk in chunks:
        try:
            sock.sendall(chunk)
        except OSError:   # it hung up on us
            break
        if select.select([sock], [], [], every_s)[0]:
            break
    said = b""
    sock.settimeout(LIVENESS_S)
    try:
        while part := sock.recv(65536):
            said += part
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open after saying {said[:200]!r}")
    return said, time.monotonic() - start


def _status_and_message(said: bytes) -> tuple[int, str]:
    head, _, body = said.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]["message"]


def _errors_of_kind(server, kind: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", headers={"x-api-key": API_KEY}).text
    prefix = f'skippy_errors_total{{kind="{kind}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


def test_slow_headers_are_cut_off(server):
    timeouts_before = _errors_of_kind(server, "request_timeout")
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Slow: ".encode()
    with _connect(server) as sock:
        said, seconds = _dribble(sock, [head] + [b"a"] * 100, every_s=0.2)   # 20 s of headers, never finished
    assert _status_and_message(said) == (408, "request headers not received within 1 s")
    assert seconds < EDGE.header_timeout_s + LIVENESS_S
    assert _errors_of_kind(server, "request_timeout") == timeouts_before + 1   # counted, though the app never saw it
    with _connect(server) as sock:   # a connection that says nothing is closed, quietly
        said, seconds = _dribble(sock, [b""], every_s=LIVENESS_S)
    assert said == b"" and seconds < EDGE.header_timeout_s + LIVENESS_S


def test_slow_body_is_cut_off(server, engine):
    body = json.dumps(_chat_body()).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Api-Key: {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with _connect(server) as sock:
        said, seconds = _dribble(sock, [head] + [bytes([b]) for b in body], every_s=0.2)
    assert _status_and_message(said) == (408, "request body not received within 1 s")
    assert b"connection: close" in said.lower() and seconds < EDGE.body_timeout_s + LIVENESS_S
    assert engine.requests == []   # nothing reached the engine


def test_refused_with_its_body_unread_the_connection_closes(server):
    # Refused before its body is read (no key), the rest of a huge body must not hold the connection.
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{").encode()
    with _connect(server) as sock:
        said, seconds = _dribble(sock, [head] + [b" "] * 100, every_s=0.2)
    assert _status_and_message(said)[0] == 401 and b"connection: close" in said.lower()
    assert seconds < LIVENESS_S
    with _connect(server) as sock:   # a keyed request's body is read: its connection stays open
        body = json.dumps(_chat_body()).encode()
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                      f"X-Api-Key: {API_KEY}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" not in reply.lower()


def test_oversized_headers_are_431(server):
    request = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Big: {'a' * 10_000}\r\n\r\n").encode()
    with _connect(server) as sock:
        said, _ = _dribble(sock, [request], every_s=LIVENESS_S)
    assert _status_and_message(said) == (431, "request line and headers exceed 8192 bytes")




@pytest.mark.parametrize("name, request_bytes, status", [
    ("garbage", b"GARBAGE\r\n\r\n", 400),
    ("non_ascii_target", b"GET /v1/\xff\xfe HTTP/1.1\r\nHOST\r\n\r\n", 400),
    ("no_host", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("no_host_http10", b"GET /health HTTP/1.0\r\n\r\n", 421),
    ("nul_in_header", b"GET /health HTTP/1.1\r\nHOST\r\nX: a\x00b\r\n\r\n", 400),
    ("two_content_lengths",
     b"POST /v1/completions HTTP/1.1\r\nHOST\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
    ("negative_content_length", b"POST /v1/completions HTTP/1.1\r\nHOST\r\nContent-Length: -5\r\n\r\n", 400),
    ("bad_chunk_size", b"POST /v1/completions HTTP/1.1\r\nHOST\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ("endless_chunk", b"POST /v1/completions HTTP/1.1\r\nHOST\r\nX-Api-Key: " + API_KEY.encode()
     + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n{", 408),
])
def test_malformed_http_is_4xx_and_closed(server, http, name, request_bytes, status):
    request_bytes = request_bytes.replace(b"HOST\r\n", f"Host: 127.0.0.1:{server.port}\r\n".encode())
    errors_before = _errors_of_kind(server, "server_error")
    with _connect(server) as sock:
        said, _ = _dribble(sock, [request_bytes], every_s=EDGE.body_timeout_s + LIVENESS_S)
    got, message = _status_and_message(said)
    assert got == status and message
    assert _errors_of_kind(server, "server_error") == errors_before and http.get("/health").status_code == 200


def test_client_gone_mid_body_is_no_server_error(server, http):
    errors_before = _errors_of_kind(server, "server_error")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Api-Key: {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode()
    with _connect(server) as sock:
        sock.sendall(head)
    deadline = time.monotonic() + LIVENESS_S   # the server notices the hang-up on its own time
    while "client_disconnect" not in http.get("/metrics").text and time.monotonic() < deadline:
        pass
    assert 'skippy_errors_total{kind="client_disconnect"}' in http.get("/metrics").text
    assert _errors_of_kind(server, "server_error") == errors_before


def _health_ok(server, source: str = "127.0.0.9") -> bool:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=LIVENESS_S) as client:
        return client.get(f"{server.url}/health").status_code == 200


def _no_connections_open(server) -> None:
    """Wait (bounded) until the server has seen every earlier test's connection close, so the caps
    below count only this test's connections."""
    connections = server.server.server_state.connections
    deadline = time.monotonic() + LIVENESS_S
    while connections and time.monotonic() < deadline:
        select.select([], [], [], 0.01)
    assert not connections, f"{len(connections)} connections still open"


def test_connection_caps_per_client_and_in_all(server):
    _no_connections_open(server)
    held = [_connect(server, "127.0.0.2") for _ in range(EDGE.max_connections_per_client)]
    try:
        with _connect(server, "127.0.0.2") as sock:   # one more from the same address
            said, _ = _dribble(sock, [b""], every_s=LIVENESS_S)
        status, message = _status_and_message(said)
        assert status == 429 and "max_connections_per_client 3" in message and "127.0.0.2" in message
        assert _health_ok(server)   # other clients are still served while one is at its cap
        held += [_connect(server, "127.0.0.3") for _ in range(EDGE.max_connections - len(held))]
        with _connect(server, "127.0.0.4") as sock:   # the server is full
            said, _ = _dribble(sock, [b""], every_s=LIVENESS_S)
        assert _status_and_message(said)[0] == 503 and "max_connections 6" in _status_and_message(said)[1]
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + LIVENESS_S   # the server sees the closes soon after; then serves again
    while not _health_ok_quiet(server) and time.monotonic() < deadline:
        pass
    assert _health_ok(server)


def _health_ok_quiet(server) -> bool:
    try:
        return _health_ok(server)
    except (httpx.HTTPError, json.JSONDecodeError):
        return False


def test_health_answers_while_slow_clients_hold_connections(server):
    # Slow clients from several addresses, each under its cap, hold connections open mid-headers.
    _no_connections_open(server)
    slow = [_connect(server, f"127.0.0.{20 + i}") for i in range(EDGE.max_connections - 2)]
    try:
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x")
        start = time.monotonic()
        assert _health_ok(server) and time.monotonic() - start < LIVENESS_S
    finally:
        for sock in slow:
            sock.close()
