"""The kinds of request a chaos round sends (skippy_zmq/devtools/chaos.py), and what of each answer a
faulted round must reproduce.

KINDS maps a name to a RequestKind: its endpoint, its own request fields for a
prompt, how its answer reads into an Outcome, and what a fault-free answer must
show for the kind to test anything. "plain" streams a greedy completion token by
token (the at_token faults count those tokens); the others answer whole:

- "json-schema": a chat constrained by a strict json_schema (a 3-property object);
- "tool-call": a chat forced to call one function (tool_choice names it); the
  parsed call (name and arguments) is compared as well as content;
- "n3": three sampled choices (temperature 0.8, fixed seed, so they differ);
- "logprobs": a greedy completion with logprobs 2 and echo; every token's
  logprob and top logprobs must be within LOGPROB_TOL of the fault-free run's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import httpx

MAX_TOKENS = 40
REQUEST_TIMEOUT_S = 900.0  # bound on a hang of a faulted request (detect + restart + generate), not a speed
# A resumed request re-prefills its generated tokens, whose KV then rounds differently in f32 than
# the one-token decodes that first wrote it: its logprobs moved by up to 1.06e-5 (text identical).
# Decoding the same request beside another one moves them by up to 3.0e-5 with no fault at all
# (another batch shape, another summation order), so equality to 1e-5 is not a property the system
# has even without faults; 1e-4 is three times that spread.
LOGPROB_TOL = 1e-4
SEED = 1234                # the n3 kind samples (temperature 0.8) with this fixed seed


@dataclass
class Outcome:
    """What of an answer a faulted round must reproduce (and the error, if it failed)."""
    text: str = ""
    error: str = ""
    tokens: int = 0
    choices: tuple[str, ...] = ()            # n > 1: every choice's text, by index
    calls: tuple[tuple[str, Any], ...] = ()  # tool calls: (name, parsed arguments)
    logprobs: tuple[tuple[str, float | None, dict[str, float] | None], ...] = ()   # (token, logprob, top)

    def differs(self, clean: "Outcome") -> str:
        """Why this is not the fault-free outcome `clean` ("" when it is)."""
        for name in ("text", "choices", "calls"):
            if getattr(self, name) != getattr(clean, name):
                return f"{name}: {getattr(self, name)!r} vs {getattr(clean, name)!r}"
        if [t for t, *_ in self.logprobs] != [t for t, *_ in clean.logprobs]:
            return "the logprobs' tokens differ"
        for i, (got, want) in enumerate(zip(self.logprobs, clean.logprobs)):
            if not _entries_close(got, want):
                return f"token {i}'s logprobs: {got[1:]} vs {want[1:]}"
        return ""


def _entries_close(got: tuple, want: tuple) -> bool:
    """One token's (token, logprob, top) against the fault-free one's, within LOGPROB_TOL."""
    (_, lp, top), (_, want_lp, want_top) = got, want
    if not _close(lp, want_lp) or (top is None) != (want_top is None):
        return False
    return top is None or (top.keys() == want_top.keys() and all(_close(top[k], want_top[k]) for k in top))


def _close(a: float | None, b: float | None) -> bool:
    return a == b if a is None or b is None else abs(a - b) <= LOGPROB_TOL


Body = dict[str, Any]
# Bounded strings and numbers: a model that never closes a string (the suite's random-weight model
# does not) still ends its answer within MAX_TOKENS, and the real model's answers fit the bounds.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "moons": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ringed": {"type": "boolean"}},
          "required": ["name", "moons", "ringed"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@dataclass(frozen=True)
class RequestKind:
    """A kind of request: its endpoint, its own fields for a prompt, how its answer reads into an
    Outcome (None: streamed, token by token, so at_token faults can fire) and what a fault-free
    answer must show for the kind to test anything ("" when it does)."""
    endpoint: str
    fields: Callable[[str], Body]
    read: Callable[[Body], Outcome] | None = None
    sane: Callable[[Outcome], str] = lambda o: "" if o.text else "no text"
    max_tokens: int = MAX_TOKENS


def _chat(prompt: str, **fields: Any) -> Body:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}


def _read_text(body: Body) -> Outcome:
    """A completion's choices (n > 1: all of them) and choice 0's logprobs."""
    choices = sorted(body["choices"], key=lambda c: c["index"])
    lp = choices[0].get("logprobs") or {}
    return Outcome(text=choices[0]["text"], tokens=body["usage"]["completion_tokens"],
                   choices=tuple(c["text"] for c in choices) if len(choices) > 1 else (),
                   logprobs=tuple(zip(lp.get("tokens", ()), lp.get("token_logprobs", ()),
                                      lp.get("top_logprobs", ()))))


def _read_chat(body: Body) -> Outcome:
    message = body["choices"][0]["message"]
    calls = tuple((c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in message.get("tool_calls") or ())
    return Outcome(text=message.get("content") or "", tokens=body["usage"]["completion_tokens"], calls=calls)


def _json_object(o: Outcome) -> str:
    try:
        value = json.loads(o.text)
    except ValueError:
        return f"not JSON: {o.text!r}"
    return "" if isinstance(value, dict) and value.keys() == SCHEMA["properties"].keys() else f"not the schema: {value}"


KINDS: dict[str, RequestKind] = {
    "plain": RequestKind("/v1/completions", lambda p: {"prompt": p, "temperature": 0, "ignore_eos": True,
                                                       "stream": True}),
    "json-schema": RequestKind("/v1/chat/completions", lambda p: _chat(p, response_format={
        "type": "json_schema", "json_schema": {"name": "planet", "schema": SCHEMA, "strict": True}}),
        _read_chat, _json_object),
    "tool-call": RequestKind("/v1/chat/completions", lambda p: _chat(p, tools=[WEATHER_TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), _read_chat,
        lambda o: "" if [name for name, _ in o.calls] == ["get_weather"] else f"calls {o.calls}, text {o.text!r}",
        # the call's fixed text plus the longest whitespace the grammar allows between its JSON tokens
        # (a random-weight model takes it every time: 40 tokens ended inside the arguments)
        max_tokens=128),
    "n3": RequestKind("/v1/completions", lambda p: {"prompt": p, "n": 3, "temperature": 0.8, "seed": SEED,
                                                    "ignore_eos": True}, _read_text,
                      lambda o: "" if len(set(o.choices)) == 3 else f"the 3 choices are not distinct: {o.choices}"),
    "logprobs": RequestKind("/v1/completions", lambda p: {"prompt": p, "temperature": 0, "ignore_eos": True,
                                                          "logprobs": 2, "echo": True}, _read_text,
                            lambda o: "" if o.logprobs and o.logprobs[-1][2] else "no logprobs"),
}



def send(base: str, request: RequestKind, prompt: str, namespace: str,
         on_token: Callable[[int], None] | None = None, speculative: bool = False,
         max_tokens: int | None = None) -> Outcome:
    """One request of this kind to the driver at `base` (max_tokens: the kind's unless given); an HTTP
    failure is the Outcome's error."""
    body = {"model": "m", "max_tokens": max_tokens or request.max_tokens, "prompt_cache_key": namespace,
            "speculative": speculative, **request.fields(prompt)}
    url = f"{base}{request.endpoint}"
    try:
        if request.read is None:
            return stream(url, body, on_token)
        resp = httpx.post(url, json=body, timeout=REQUEST_TIMEOUT_S)
        if resp.status_code != 200:
            return Outcome(error=f"HTTP {resp.status_code}: {resp.text[:300]}")
        return request.read(resp.json())
    except httpx.HTTPError as exc:
        return Outcome(error=f"{type(exc).__name__}: {exc}")


def stream(url: str, body: Body, on_token: Callable[[int], None] | None) -> Outcome:
    """A streamed completion's text, one event a token; `on_token` hears each token's count."""
    out = Outcome()
    with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as resp:
        if resp.status_code != 200:
            resp.read()
            return Outcome(error=f"HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"].get("message", str(event["error"]))
                return out
            if event.get("choices"):
                out.text += event["choices"][0]["text"]
                out.tokens += 1
                if on_token:
                    on_token(out.tokens)
    return out
