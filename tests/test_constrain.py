"""The constraint engine (skippy_zmq/text/constrain.py) with the real SmolLM2 tokenizer: request
parsing and its errors, random walks whose decoded text must parse and validate, rollback."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.text.constrain import SYNTAXES, ConstraintError, ConstraintSpec, Matcher, tokenizer_info, validate
from skippy_zmq.text.tools import GENERIC, validate_tools
from skippy_zmq.sampling import Sampler, SamplingParams, mask_logits

SCHEMAS = json.loads((Path(__file__).parent / "fixtures" / "json_schemas.json").read_text())

CLOSERS = set('"}]')
OPENERS = set("{[,:")  # a comma or colon opens another member


@pytest.fixture(scope="module")
def info(model_dir):
    return tokenizer_info(model_dir)


@pytest.fixture(scope="module")
def closing_tokens(info) -> np.ndarray:
    """Tokens that close a string, object or array and start nothing new: the walk's bias to end."""
    texts = [info.tokenizer.decode([i]) for i in range(info.vocab_size)]
    return np.array([bool(set(t) & CLOSERS) and not set(t) & OPENERS for t in texts])


def allows_only_eos(matcher: Matcher) -> bool:
    """Whether the constraint is complete: its mask allows EOS and nothing else."""
    return set(np.flatnonzero(matcher.mask()).tolist()) == set(matcher.info.eos_ids)


def random_walk(matcher: Matcher, closing: np.ndarray, rng: np.random.Generator,
                max_tokens: int = 300) -> list[int]:
    """Sample allowed tokens at random, half the time among closing ones, until EOS (taken as soon as
    the mask allows it and nothing else, else half the time it is allowed)."""
    eos = matcher.info.eos_ids[0]
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        mask = matcher.mask()
        eos_allowed = bool(mask[eos])
        mask[list(matcher.info.eos_ids)] = False
        if eos_allowed and (not mask.any() or rng.random() < 0.5):
            matcher.advance(eos)
            return tokens
        closing_allowed = np.flatnonzero(mask & closing)
        pool = closing_allowed if len(closing_allowed) and rng.random() < 0.5 else np.flatnonzero(mask)
        token = int(rng.choice(pool))
        matcher.advance(token)
        tokens.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {matcher.info.tokenizer.decode(tokens)!r}")


def walk_and_check(info, closing, schema: dict | None, seed: int) -> None:
    spec = ConstraintSpec("json_object") if schema is None else ConstraintSpec("json_schema", schema)
    tokens = random_walk(Matcher(spec, info), closing, np.random.default_rng(seed))
    text = info.tokenizer.decode(tokens)
    value = json.loads(text)
    jsonschema.validate(value, schema or {"type": "object"}, cls=jsonschema.Draft202012Validator)


# --- request parsing ---------------------------------------------------------------------------

def test_from_openai_forms():
    assert ConstraintSpec.from_openai() is None
    assert ConstraintSpec.from_openai({"type": "text"}) is None
    assert ConstraintSpec.from_openai({"type": "json_object"}) == ConstraintSpec("json_object")
    schema = SCHEMAS["flat"]
    spec = ConstraintSpec.from_openai({"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": schema, "strict": True}})
    assert spec == ConstraintSpec("json_schema", schema) and spec.param == "response_format"
    # llama-server's form: a schema beside json_object
    assert ConstraintSpec.from_openai({"type": "json_object", "schema": schema}) == spec
    gbnf = ConstraintSpec.from_openai(grammar='root ::= "a"')
    assert gbnf == ConstraintSpec("grammar", grammar='root ::= "a"', syntax="gbnf")
    lark = ConstraintSpec.from_openai(grammar={"type": "lark", "value": 'start: "a"'})
    assert (lark.kind, lark.syntax, lark.param) == ("grammar", "lark", "grammar")


def test_spec_round_trips_as_json():
    for spec in (ConstraintSpec("json_object"), ConstraintSpec("json_schema", SCHEMAS["nested"]),
                 ConstraintSpec("grammar", grammar='start: "x"', syntax="lark")):
        back = ConstraintSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert back == spec and hash(back) == hash(spec)
    schema = {"type": "object"}
    spec = ConstraintSpec("json_schema", schema)
    schema["type"] = "string"  # the spec keeps its own copy
    assert spec.schema == {"type": "object"}
    for bad in ({"kind": "xml"}, {"kind": "json_schema"}, {"kind": "grammar", "grammar": "x"},
                {"kind": "json_object", "extra": 1}, {"kind": "json_schema", "schema": {"a": {1, 2}}}, [1]):
        with pytest.raises(ConstraintError):
            ConstraintSpec.from_dict(bad)


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": "json"}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format",
     "response_format.json_schema.schema"),
    ({"grammar": 5}, "grammar", "grammar must be"),
    ({"grammar": {"type": "regex", "value": "a+"}}, "grammar", "grammar must be"),
    ({"grammar": "  "}, "grammar", "non-empty"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar",
     "cannot be combined"),
])
def test_from_openai_errors_name_the_parameter(kwargs, param, words):
    with pytest.raises(ConstraintError, match=words) as caught:
        ConstraintSpec.from_openai(**kwargs)
    assert caught.value.param == param


@pytest.mark.parametrize("schema, words", [
    ({"type": "strin"}, "Invalid type"),
    ({"not": {"type": "string"}}, "Unimplemented keys"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z"}}}, "regex"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Unsatisfiable"),
    ({"$ref": "#"}, "admits no output"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf"),
    ({"type": "object", "properties": 5}, "properties"),
])
def test_bad_schema_is_a_constraint_error(info, schema, words):
    with pytest.raises(ConstraintError, match=words) as caught:
        validate(ConstraintSpec("json_schema", schema), info)
    assert "invalid JSON schema" in str(caught.value) and caught.value.param == "response_format"


@pytest.mark.parametrize("grammar, syntax", [
    ('root ::= "a" | ( "b" ', "gbnf"),
    ("root ::= undefined_rule", "gbnf"),
    ("root ::= root", "gbnf"),
    ('start: "a" (', "lark"),
    ('start: "unterminated', "lark"),
    ("start: missing", "lark"),
])
def test_bad_grammar_is_a_constraint_error(info, grammar, syntax):
    with pytest.raises(ConstraintError, match=rf"invalid grammar \({syntax}\)") as caught:
        validate(ConstraintSpec("grammar", grammar=grammar, syntax=syntax), info)
    assert caught.value.param == "grammar"


# Any mix of keywords and values (mostly nonsense): compiled, or refused as a ConstraintError.
_KEYWORDS = ["type", "properties", "items", "required", "enum", "const", "anyOf", "allOf", "oneOf",
             "$ref", "minimum", "maximum", "minItems", "maxItems", "pattern", "format",
             "additionalProperties", "minLength", "maxLength", "not", "$defs"]
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False, width=16)
    | st.sampled_from(["object", "string", "integer", "array", "#", "#/$defs/a", "[a-", "a|b", "date"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYWORDS + ["a", "b"]),
                                                                 inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=st.dictionaries(st.sampled_from(_KEYWORDS), _VALUES, max_size=4))
def test_any_schema_compiles_or_is_a_constraint_error(info, schema):
    try:
        validate(ConstraintSpec("json_schema", schema), info)
    except ConstraintError as exc:
        assert str(exc).startswith("invalid JSON schema: ") and "\n" not in str(exc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet='root:=| "ab[]()*+?-\\\nx\u00e9', max_size=30), syntax=st.sampled_from(SYNTAXES))
def test_any_grammar_compiles_or_is_a_constraint_error(info, text, syntax):
    try:
        validate(ConstraintSpec("grammar", grammar=text, syntax=syntax), info)
    except ConstraintError as exc:
        assert exc.param == "grammar"


def test_tool_call_spec(info):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "now"}}]
    # a forced call is a json_schema after the format's prefix (skippy_zmq.text.tools)
    assert GENERIC.constraint(validate_tools(tools, "auto")) is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        matcher = Matcher(GENERIC.constraint(validate_tools(tools, choice)), info)
        text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
        for token in info.tokenizer.encode(text, add_bos=False):
            matcher.advance(token)
        assert allows_only_eos(matcher)


def test_tool_call_walk(info, closing_tokens):
    params = {"type": "object", "properties": {"city": {"type": "string"},
                                               "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    spec = GENERIC.constraint(validate_tools(tools, "required"))
    for seed in range(10):
        text = info.tokenizer.decode(random_walk(Matcher(spec, info), closing_tokens,
                                                 np.random.default_rng(seed)))
        call = json.loads(text)
        assert call["name"] in ("get_weather", "now")
        arguments_schema = params if call["name"] == "get_weather" else {"type": "object"}
        jsonschema.validate(call["arguments"], arguments_schema)


# --- matching ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("seed", range(4))
def test_random_walk_validates(info, closing_tokens, name, seed):
    walk_and_check(info, closing_tokens, SCHEMAS[name], seed)


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_json_object(info, closing_tokens, seed):
    walk_and_check(info, closing_tokens, None, seed)


def test_random_walk_many_seeds(info, closing_tokens):
    # The issue's goal (50 seeds x 5 schemas, all valid), plus JSON mode; about a second.
    for name in ("flat", "nested", "enum", "array_of_objects", "required_optional", None):
        for seed in range(100, 150):
            walk_and_check(info, closing_tokens, SCHEMAS.get(name), seed)


# Structurally valid schemas of every kind the engine supports, nested: each output must validate.
_PROPERTY = st.sampled_from(["a", "b", "id", "name", "x_y", "\u03ba"])
_LEAF_SCHEMAS = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 5)),
    st.builds(lambda lo, extra: {"type": "integer", "minimum": lo, "maximum": lo + extra},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda values: {"enum": values},
              st.lists(st.one_of(st.text('ab \u00e9"\\', max_size=4), st.integers(-5, 5), st.none()),
                       min_size=1, max_size=4, unique_by=lambda v: (type(v).__name__, v))),
    st.builds(lambda value: {"const": value}, st.text("xyz", max_size=3)),
    st.sampled_from([{"type": "string", "pattern": p} for p in ("^[a-z]{1,4}$", "^\\d{3}-\\d{2}$")]),
)


def _container_schemas(inner):
    def obj(props, required, closed):
        return {"type": "object", "properties": props, "additionalProperties": closed,
                "required": [name for name, keep in zip(props, required, strict=False) if keep]}
    return st.one_of(
        st.builds(obj, st.dictionaries(_PROPERTY, inner, min_size=1, max_size=3),
                  st.lists(st.booleans(), min_size=3, max_size=3), st.booleans()),
        st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                            "maxItems": lo + extra},
                  inner, st.integers(0, 2), st.integers(0, 3)),
        st.builds(lambda options: {"anyOf": options}, st.lists(inner, min_size=1, max_size=3)),
    )


_SCHEMAS = _container_schemas(st.recursive(_LEAF_SCHEMAS, _container_schemas, max_leaves=8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS, seed=st.integers(0, 5))
def test_generated_schemas_walk_to_valid_json(info, closing_tokens, schema, seed):
    walk_and_check(info, closing_tokens, schema, seed)


def test_grammar_walk(info, closing_tokens):
    gbnf = 'root ::= "[" item ("," " "? item)* "]"\nitem ::= [a-z]+ | [0-9]+\n'
    for syntax, text in (("gbnf", gbnf), ("lark", 'start: "yes" | "no" | /[0-9]{1,3}/')):
        matcher = Matcher(ConstraintSpec("grammar", grammar=text, syntax=syntax), info)
        tokens = random_walk(matcher, closing_tokens, np.random.default_rng(0))
        out = info.tokenizer.decode(tokens)
        assert (out in ("yes", "no") or out.isdigit()) if syntax == "lark" else out.startswith("[")


def test_only_eos_when_complete(info):
    matcher = Matcher(ConstraintSpec("json_schema", SCHEMAS["enum"]), info)
    for token in info.tokenizer.encode('{"color": "red", "size": "S", "level": 3}', add_bos=False):
        assert not allows_only_eos(matcher)
        matcher.advance(token)
    assert allows_only_eos(matcher)
    logits = np.zeros(info.vocab_size + 8, np.float32)  # a padded vocabulary
    mask_logits(logits, matcher.mask())
    assert set(np.flatnonzero(np.isfinite(logits))) == set(info.eos_ids)


def test_special_tokens_never_inside_json(info):
    matcher = Matcher(ConstraintSpec("json_object"), info)
    for token in info.tokenizer.encode('{"a": "b', add_bos=False):
        matcher.advance(token)
    special = list(info.tokenizer.tokenizer.get_added_tokens_decoder())
    assert matcher.mask().sum() > 40_000 and not matcher.mask()[special].any()


def test_invalid_token_raises_and_keeps_state(info):
    matcher = Matcher(ConstraintSpec("json_object"), info)
    before = matcher.mask().copy()
    bad = info.tokenizer.encode("hello", add_bos=False)[0]
    with pytest.raises(ConstraintError, match="not allowed"):
        matcher.advance(bad)
    with pytest.raises(ConstraintError, match="not allowed"):
        matcher.advance(info.eos_ids[0])  # not before the object is complete
    assert matcher.length == 0 and (matcher.mask() == before).all()
    matcher.advance(info.tokenizer.encode("{", add_bos=False)[0])
    assert matcher.length == 1


def test_rollback_gives_the_same_masks(info, closing_tokens):
    spec = ConstraintSpec("json_schema", SCHEMAS["array_of_objects"])
    reference = Matcher(spec, info)
    tokens = random_walk(reference, closing_tokens, np.random.default_rng(7)) + [info.eos_ids[0]]
    matcher = Matcher(spec, info)
    masks = []
    for token in tokens:
        masks.append(matcher.mask().copy())
        matcher.advance(token)
    rng = np.random.default_rng(1)
    for _ in range(10):
        k = matcher.length
        j = int(rng.integers(0, k + 1))
        matcher.rollback(j)
        assert matcher.length == k - j
        for position in range(k - j, len(tokens)):
            assert (matcher.mask() == masks[position]).all(), position
            matcher.advance(tokens[position])
        assert matcher.length == len(tokens) and allows_only_eos(matcher)   # EOS taken: only EOS follows
    with pytest.raises(ValueError):
        matcher.rollback(matcher.length + 1)


def test_window_drafts_stop_the_matcher_at_the_first_refused_one(info):
    """A verify window's drafts, put into the sampler, move its matcher: each position is masked as
    after the drafts before it, the first draft the constraint refuses stops it there (no mask
    from there on), and truncating to the drafts the verifier accepted rolls it back to their state."""
    spec = ConstraintSpec("json_schema", SCHEMAS["flat"])
    text = '{"name": "Ada", "age": 36, "score": 1.5, "active": true}'
    tokens = info.tokenizer.encode(text, add_bos=False)
    probe = Matcher(spec, info)
    masks = [probe.mask().copy()]
    for token in tokens[:4]:
        probe.advance(token)
        masks.append(probe.mask().copy())
    bad = int(np.flatnonzero(~masks[4])[0])
    drafts = tokens[:4] + [bad] + tokens[5:7]
    prompt = [1]                                 # the drafts are the generated tokens from position 1 on
    matcher = Matcher(spec, info)
    sampler = Sampler(SamplingParams(), prompt, matcher=matcher)
    sampler.put(len(prompt), drafts)
    for j in range(5):                           # the mask for the token after drafts[:j]
        np.testing.assert_array_equal(sampler.constraint_mask(j), masks[j])
    assert sampler.constraint_mask(5) is None and sampler.constraint_mask(7) is None
    assert sampler.refused_at == 4 and matcher.length == 4
    sampler.truncate(len(prompt) + 2)            # the verifier accepted two drafts
    np.testing.assert_array_equal(sampler.constraint_mask(2), masks[2])
    assert matcher.length == 2


def test_mask_logits_and_stats(info):
    matcher = Matcher(ConstraintSpec("json_object"), info)
    seconds, count = info.mask_stats.snapshot()
    logits = np.random.default_rng(0).standard_normal((3, info.vocab_size)).astype(np.float32)
    allowed = matcher.mask()
    mask_logits(logits, allowed)
    assert np.isfinite(logits[:, allowed]).all() and np.isneginf(logits[:, ~allowed]).all()
    assert info.mask_stats.snapshot()[1] == count + 1 and info.mask_stats.mean_us > 0
    with pytest.raises(ValueError):
        mask_logits(np.zeros(10, np.float32), allowed)
