"""Structured-output constraints (JSON mode, JSON schema, GBNF/Lark grammars).

A request's constraint travels as a `ConstraintSpec` (plain JSON in a message's extras). The
driver checks it once with `validate` (a `ConstraintError` becomes a 400); the final stage
builds one `Matcher` per request, masks the logits with `Matcher.apply` before sampling and
calls `Matcher.advance` with each sampled token. Masks come from llguidance (see
scripts/bench_constrain.py for why): an Earley parser over a lazily built lexer, so a schema
compiles in well under a millisecond and a mask costs about ten microseconds.

EOS is ours, not the engine's: the model's end-of-generation ids are allowed exactly when the
grammar is in an accepting state, and once the grammar can take no more bytes they are the
only tokens allowed, so the final stage must emit EOS then.

Objects are closed where a schema leaves `additionalProperties` unsaid (`close_objects`), as
llama.cpp's json-schema-to-grammar does and OpenAI's strict mode requires: llguidance follows
JSON Schema there (extra keys allowed) and has no option to change it, so the schema is
rewritten before it is compiled. A forced tool call is a json_schema (or, for a format that
names the function outside the JSON, a Lark grammar built with `lark_json`); see
skippy_zmq.text.tools.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import llguidance
import numpy as np

from skippy_zmq.text.tokenizer import META_FILE, TextTokenizer

Kind = Literal["json_object", "json_schema", "grammar"]
Syntax = Literal["gbnf", "lark"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "grammar")
SYNTAXES: tuple[str, ...] = ("gbnf", "lark")

# Whitespace between JSON tokens: one space, or a newline and up to 20 spaces/tabs (what
# llama.cpp's json.gbnf allows). Unbounded whitespace lets a small model loop on newlines.
JSON_WHITESPACE = r"(?:\x20|\n[\x20\t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}

COMPILE_CACHE_SIZE = 32

# The request parameter each kind comes from, named in error messages.
_PARAM = {"json_object": "response_format", "json_schema": "response_format", "grammar": "grammar"}


class ConstraintError(ValueError):
    """A constraint that cannot be used; `param` names the request parameter it came from."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _canonical(value: Any) -> str:
    # Not sorted: property order is the order the engine makes the output follow.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request's output must match. `schema` is a JSON schema (json_schema); `grammar`
    is GBNF or Lark text."""

    kind: Kind
    schema: dict[str, Any] | None = None
    grammar: str | None = None
    syntax: Syntax | None = None
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        param = _PARAM[self.kind]
        if self.kind == "json_schema" and not isinstance(self.schema, dict):
            raise ConstraintError(f"a {self.kind} constraint needs a JSON schema object", param)
        if self.kind in ("json_object", "grammar") and self.schema is not None:
            raise ConstraintError(f"a {self.kind} constraint takes no schema", param)
        if self.kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ConstraintError("grammar must be a non-empty string", param)
            if self.syntax not in SYNTAXES:
                raise ConstraintError(f"grammar syntax must be gbnf or lark; got {self.syntax!r}", param)
        elif self.grammar is not None or self.syntax is not None:
            raise ConstraintError(f"a {self.kind} constraint takes no grammar", param)
        try:
            key = _canonical(self.to_dict())
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"the schema is not JSON: {exc}", param) from None
        object.__setattr__(self, "_key", key)
        if self.schema is not None:  # our own copy: the caller's dict may change, the key may not
            object.__setattr__(self, "schema", json.loads(key)["schema"])

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def param(self) -> str:
        return _PARAM[self.kind]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for name in ("schema", "grammar", "syntax"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConstraintSpec:
        if not isinstance(data, dict) or set(data) - {"kind", "schema", "grammar", "syntax"}:
            raise ConstraintError(f"not a constraint spec: {data!r:.200}")
        return cls(data.get("kind"), data.get("schema"), data.get("grammar"), data.get("syntax"))

    @classmethod
    def from_openai(cls, response_format: Any = None, grammar: Any = None) -> ConstraintSpec | None:
        """The constraint of an OpenAI request's `response_format` and our `grammar` extension
        (a GBNF string, or `{"type": "gbnf"|"lark", "value": text}`); None when unconstrained."""
        from_format = _from_response_format(cls, response_format)
        from_grammar = _from_grammar(cls, grammar)
        if from_format is not None and from_grammar is not None:
            raise ConstraintError("grammar cannot be combined with a JSON response_format", "grammar")
        return from_format or from_grammar


def _from_response_format(cls: type[ConstraintSpec], value: Any) -> ConstraintSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        # llama-server's extension: a schema alongside json_object.
        schema = value.get("schema")
        return cls("json_object") if schema is None else _schema_spec(cls, schema, "response_format.schema")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise ConstraintError("response_format.json_schema must be an object with a 'schema'",
                                  "response_format")
        return _schema_spec(cls, body["schema"], "response_format.json_schema.schema")
    raise ConstraintError("response_format.type must be 'text', 'json_object' or 'json_schema'; "
                          f"got {kind!r}", "response_format")


def _schema_spec(cls: type[ConstraintSpec], schema: Any, where: str) -> ConstraintSpec:
    if not isinstance(schema, dict):
        raise ConstraintError(f"{where} must be a JSON schema object; got {type(schema).__name__}",
                              "response_format")
    return cls("json_schema", schema)


def _from_grammar(cls: type[ConstraintSpec], value: Any) -> ConstraintSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        return cls("grammar", grammar=value, syntax="gbnf")
    if isinstance(value, dict) and value.get("type") in SYNTAXES and isinstance(value.get("value"), str):
        return cls("grammar", grammar=value["value"], syntax=value["type"])
    raise ConstraintError('grammar must be a GBNF string or {"type": "gbnf"|"lark", "value": text}',
                          "grammar")


def _engine_grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar text of a spec (not yet checked)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(close_objects(spec.schema), overrides=_JSON_OPTIONS)
    return llguidance.grammar_from(spec.syntax, spec.grammar)


# Keywords whose value is one subschema, or a map / list of them (allOf's parts are left open:
# closing each part would refuse the keys the other parts add).
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def close_objects(schema: Any, close_self: bool = True) -> Any:
    """The schema with every object that lists `properties` but says nothing of
    `additionalProperties` (nor patternProperties / unevaluatedProperties) closed to them; a
    bare {"type": "object"} still takes any object, and `additionalProperties: true` keeps
    extra keys (llama.cpp's common/json-schema.cpp reads schemas the same way)."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA or key in _SUBSCHEMA_LISTS:
            out[key] = close_objects(value)
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(part, close_self=False) for part in value]
        else:
            out[key] = value
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if close_self and isinstance(schema.get("properties"), dict) and not any(k in schema for k in open_keys):
        out["additionalProperties"] = False
    return out


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for `schema`, objects closed and whitespace as in JSON constraints."""
    return f"%json {_canonical({**close_objects(schema), 'x-guidance': _JSON_OPTIONS})}"


# Terse engine errors: no parser-state dumps in 400s or logs.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def _engine_error(text: str, empty: str = "no token allowed") -> str:
    """The engine's message on one line, without its trailing parser-state block."""
    message = " ".join(text.split("\n<", 1)[0].split())[:500]
    if message.startswith("NoExtension"):
        return "it admits no output (a rule that can only refer to itself?)"
    return message or empty


def _describe(spec: ConstraintSpec) -> str:
    return {"json_object": "JSON object constraint", "json_schema": "JSON schema",
            "grammar": f"grammar ({spec.syntax})"}[spec.kind]


@dataclass
class MaskStats:
    """Time spent computing token masks, for /metrics (mask time per token)."""

    seconds: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds
            self.count += 1

    def snapshot(self) -> tuple[float, int]:
        with self._lock:
            return self.seconds, self.count

    @property
    def mean_us(self) -> float:
        seconds, count = self.snapshot()
        return seconds / count * 1e6 if count else 0.0


def _bitmask_of(tokens: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """The engine's mask layout (bit t % 32 of int32 word t // 32) allowing just `tokens`."""
    flags = np.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    flags[list(tokens)] = True
    return np.packbits(flags, bitorder="little").view(np.int32)


class TokenizerInfo:
    """One model's tokenizer as the grammar engine sees it, with a small LRU of compiled
    constraints and the mask-time counter of every matcher built on it."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int | None = None) -> None:
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        if self.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {self.vocab_size} < tokenizer's {tokenizer.vocab_size}")
        self.eos_ids = tuple(int(i) for i in tokenizer.eos_ids)
        if not self.eos_ids:
            raise ConstraintError("the model has no end-of-generation token; constraints need one")
        try:
            self.engine_tokenizer = llguidance.LLTokenizer(
                tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_ids))
        except Exception as exc:  # noqa: BLE001 - any engine refusal is "unsupported tokenizer"
            raise ConstraintError(f"the grammar engine cannot use this tokenizer: {exc}") from None
        self.eos_bitmask = _bitmask_of(self.eos_ids, self.vocab_size)
        self.tokenizer = tokenizer
        self.mask_stats = MaskStats()
        self._compiled: OrderedDict[ConstraintSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compiled(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """A pristine matcher for `spec` (callers deep-copy it); ConstraintError if it will not compile."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        template = self._compile(spec)
        with self._lock:
            self._compiled[spec] = template
            while len(self._compiled) > COMPILE_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template

    def _compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        try:
            error, template = self._build(_engine_grammar(spec))
        except Exception as exc:  # noqa: BLE001 - the engine's errors are the user's errors here
            error, template = str(exc), None
        if template is None:
            detail = _engine_error(error, "no token can start it")
            raise ConstraintError(f"invalid {_describe(spec)}: {detail}", spec.param)
        return template

    def _build(self, grammar: str) -> tuple[str, llguidance.LLMatcher | None]:
        """("", a matcher) or (the engine's error, None). The matcher's first mask is computed
        here: that builds the lexer states its copies share, and a grammar that cannot even
        start fails now, not mid-request."""
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.engine_tokenizer, limits=_LIMITS)
        if failed:
            return (messages or [""])[0], None
        matcher = llguidance.LLMatcher(self.engine_tokenizer, grammar, log_level=0, limits=_LIMITS)
        scratch = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error() or not scratch.any():
            return matcher.get_error(), None
        return "", matcher


@lru_cache(maxsize=4)
def _cached_info(model_dir: str, vocab_size: int | None) -> TokenizerInfo:
    directory = Path(model_dir)
    tokenizer = (TextTokenizer.load(directory) if (directory / META_FILE).is_file()
                 else TextTokenizer.from_hf_dir(directory))
    return TokenizerInfo(tokenizer, vocab_size)


def tokenizer_info(model_dir: str | Path, vocab_size: int | None = None) -> TokenizerInfo:
    """The (cached) TokenizerInfo of a model directory holding tokenizer.json; `vocab_size`
    is the logits width when the model pads its vocabulary past the tokenizer's."""
    return _cached_info(str(Path(model_dir).resolve()), vocab_size)


def validate(spec: ConstraintSpec, info: TokenizerInfo) -> None:
    """Compile `spec` (cached) so a bad one fails here, as a ConstraintError, not mid-generation."""
    info.compiled(spec)


class Matcher:
    """One request's constraint state on the final stage."""

    def __init__(self, spec: ConstraintSpec, info: TokenizerInfo) -> None:
        self.spec = spec
        self.info = info
        self._engine = info.compiled(spec).deep_copy()
        self._bitmask = np.zeros((info.vocab_size + 31) // 32, dtype=np.int32)
        self._mask_state = -1  # the length the bitmask was computed at; -1: stale
        self._eos_at: int | None = None  # the position of an advanced EOS (the engine never sees it)
        self.length = 0

    def _fill(self) -> np.ndarray:
        if self._mask_state == self.length:
            return self._bitmask
        if self._eos_at is not None:
            self._bitmask[:] = self.info.eos_bitmask
        else:
            start = time.perf_counter()
            self._engine.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
            self.info.mask_stats.add(time.perf_counter() - start)
            if self._engine.is_error() or not self._bitmask.any():
                raise self._engine_failure("cannot continue")
        self._mask_state = self.length
        return self._bitmask

    def _engine_failure(self, what: str) -> ConstraintError:
        # The engine hit a limit or a state it cannot leave; the request must end.
        detail = _engine_error(self._engine.get_error())
        return ConstraintError(f"the {_describe(self.spec)} {what}: {detail}", self.spec.param)

    def mask(self) -> np.ndarray:
        """The allowed next tokens as a bool array of vocab_size."""
        bits = np.unpackbits(self._fill().view(np.uint8), bitorder="little", count=self.info.vocab_size)
        return bits.view(bool)

    def allows(self, token: int) -> bool:
        return 0 <= token < self.info.vocab_size and bool((self._fill()[token >> 5] >> (token & 31)) & 1)

    def advance(self, token: int) -> None:
        """Take `token`; ConstraintError (state unchanged) if the constraint does not allow it."""
        token = int(token)
        if not self.allows(token):
            text = self.info.tokenizer.token_text(token) if 0 <= token < self.info.vocab_size else "?"
            raise ConstraintError(f"token {token} ({text!r}) is not allowed by the "
                                  f"{_describe(self.spec)} after {self.length} tokens", self.spec.param)
        if token in self.info.eos_ids:
            self._eos_at = self._eos_at if self._eos_at is not None else self.length
        elif not self._engine.consume_token(token):
            raise self._engine_failure(f"refused token {token}")
        self.length += 1

    def rollback(self, n: int) -> None:
        """Undo the last `n` advances (speculative drafts past the accepted length)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        target = self.length - n
        engine_tokens = n
        if self._eos_at is not None:
            # EOS, and the EOS-only tokens after it, never reached the engine: only the tokens
            # before it that are rolled back do (none when EOS stays, _eos_at < target).
            engine_tokens = max(0, self._eos_at - target)
            if self._eos_at >= target:
                self._eos_at = None
        if engine_tokens and not self._engine.rollback(engine_tokens):
            raise self._engine_failure(f"cannot roll back {engine_tokens} tokens")
        if self._mask_state > target:
            self._mask_state = -1  # computed past the new end: stale
        self.length = target
