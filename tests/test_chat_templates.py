"""Chat templates: llama.cpp's 70 real templates render byte for byte as transformers renders them
(fixtures from scripts/make_template_fixtures.py), the Jinja environment's extras, and the
templates of HF directories (as transformers 4 and 5 save them) and GGUF files."""

from __future__ import annotations

import hashlib
import json
import struct
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
from jinja2 import meta
from jinja2.exceptions import SecurityError, TemplateError

from skippy_zmq.text.chat_template import ChatTemplate, ChatTemplates, chat_environment, generation_eos_ids, gguf_templates, read_hf_templates
from skippy_zmq.text.tokenizer import TextTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
CASES = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))
TEMPLATE_FIXTURES = sorted(p for p in FIXTURES.glob("*.json") if p.name != "cases.json")
SMOLLM2_DIR = Path(__file__).parent.parent / "models" / "smollm2-135m-instruct"
WEATHER = CASES["tools"]["tools"]
ECHO = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"


def render_case(template: ChatTemplate, case: dict, bos: str, eos: str) -> str:
    return template.render(
        case["messages"], case.get("add_generation_prompt", True), bos_token=bos, eos_token=eos,
        tools=case.get("tools"), documents=case.get("documents"), **case.get("kwargs", {}))


_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _skip_gguf_value(f, kind: int) -> None:
    if kind == _GGUF_STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _GGUF_ARRAY:
        elem, count = struct.unpack("<IQ", f.read(12))
        if elem in _GGUF_SCALAR_SIZES:
            f.seek(_GGUF_SCALAR_SIZES[elem] * count, 1)
        else:
            for _ in range(count):
                _skip_gguf_value(f, elem)
    else:
        f.seek(_GGUF_SCALAR_SIZES[kind], 1)


def gguf_template_fields(path: Path) -> SimpleNamespace:
    """A stand-in for gguf.GGUFReader holding only the chat-template strings: the vocab files'
    token arrays take GGUFReader tens of seconds to parse, these few strings milliseconds."""
    fields = {}
    with path.open("rb") as f:
        magic, _version, _tensors, kv_count = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF", path
        for _ in range(kv_count):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8")
            kind = struct.unpack("<I", f.read(4))[0]
            if kind == _GGUF_STRING and key.startswith("tokenizer.chat_template"):
                value = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8")
                fields[key] = SimpleNamespace(contents=lambda value=value: value)
            else:
                _skip_gguf_value(f, kind)
    return SimpleNamespace(fields=fields)


def template_text(fixture: dict, models: Path) -> str:
    """The template a fixture was rendered from: templates/<name>.jinja, or a field of a vocab GGUF."""
    if "gguf" in fixture:
        return gguf_template_fields(models / fixture["gguf"]).fields[fixture["gguf_field"]].contents()
    return (models / "templates" / fixture["template"]).read_text(encoding="utf-8")


@pytest.mark.parametrize("fixture_path", TEMPLATE_FIXTURES, ids=lambda p: p.stem)
def test_real_template_renders_as_transformers(fixture_path: Path, llama_cpp_models: Path) -> None:
    fixture = json.loads(fixture_path.read_text(encoding="utf-8"))
    text = template_text(fixture, llama_cpp_models)
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == fixture["sha256"], (
        f"{fixture['template']} changed: rerun scripts/make_template_fixtures.py")
    now = datetime.fromisoformat(fixture["now"])
    template = ChatTemplate(text, now=lambda: now)
    for name, expected in fixture["renders"].items():
        case, bos, eos = CASES[name], fixture["bos_token"], fixture["eos_token"]
        if "error" in expected:
            with pytest.raises(TemplateError) as raised:
                render_case(template, case, bos, eos)
            assert expected["message"] in str(raised.value), name
        else:
            assert render_case(template, case, bos, eos) == expected["text"], name


def test_corpus_covers_every_template_and_tools(llama_cpp_models: Path) -> None:
    fixtures = [json.loads(p.read_text(encoding="utf-8")) for p in TEMPLATE_FIXTURES]
    names = {f["template"] for f in fixtures if "gguf" not in f}
    assert names == {p.name for p in (llama_cpp_models / "templates").glob("*.jinja")}
    assert len(names) == 70
    rendered = [(json.loads(p.read_text(encoding="utf-8"))["renders"]) for p in TEMPLATE_FIXTURES]
    assert sum("text" in r.get("tool_calls", {}) for r in rendered) >= 50


# --- the environment's extras ---------------------------------------------------------------

def test_strftime_now_uses_the_given_clock() -> None:
    fixed = datetime(2024, 2, 29, 8, 0, 0)
    out = ChatTemplate("{{ strftime_now('%d %b %Y') }}", now=lambda: fixed).render([])
    assert out == "29 Feb 2024"


def test_generation_block_renders_its_body() -> None:
    text = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert ChatTemplate(text).render([{"role": "assistant", "content": "hi"}]) == "<hi>"


def test_tojson_takes_transformers_keywords_and_keeps_non_ascii() -> None:
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2, sort_keys=True) }}|"
                            "{{ x | tojson(separators=(',', ':'), ensure_ascii=True) }}")
    out = template.render([], x={"b": "<é>", "a": 1})
    assert out == '{"b": "<é>", "a": 1}|{\n  "a": 1,\n  "b": "<é>"\n}|{"b":"<\\u00e9>","a":1}'


def test_raise_exception_and_template_bugs_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="^no system$"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ 'a' + messages[0] }}").render([{"role": "user"}])


def test_namespace_refuses_underscore_names_and_dict_works() -> None:
    assert ChatTemplate("{% set ns = namespace(n=1) %}{% set ns.n = 2 %}{{ ns.n }}"
                        "{{ dict(a=1) | tojson }}").render([]) == '2{"a": 1}'
    with pytest.raises(SecurityError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


def test_messages_lose_none_keys_and_reasoning_is_aliased() -> None:
    text = "{% for m in messages %}{{ m.keys() | list | tojson }}{% endfor %}"
    messages = [{"role": "assistant", "content": None, "reasoning": "r"}]
    assert ChatTemplate(text).render(messages) == '["thinking", "role", "reasoning", "reasoning_content"]'


def test_template_kwargs_documents_and_tools_reach_the_template() -> None:
    text = "{{ enable_thinking }}|{{ documents[0].title }}|{{ tools[0].function.name }}|{{ bos_token }}"
    out = ChatTemplate(text).render([], enable_thinking=False, documents=[{"title": "T", "text": "x"}],
                                    tools=WEATHER, bos_token="<s>")
    assert out == "False|T|get_weather|<s>"
    with pytest.raises(TypeError, match="documents"):
        ChatTemplate(text).render([], documents=["x"])


# --- choosing among a model's templates -----------------------------------------------------

def test_tool_use_template_is_chosen_with_tools_and_names_select() -> None:
    templates = ChatTemplates("D", {"tool_use": "T", "rag": "R"})
    assert templates.text_for() == "D" and templates.text_for(tools=WEATHER) == "T"
    assert templates.text_for("rag") == "R" and templates.text_for("default", tools=WEATHER) == "D"
    with pytest.raises(ValueError, match="template text is not accepted"):   # templates belong to the model
        templates.text_for("{{ 'inline' }}")
    with pytest.raises(ValueError, match=r"no chat template named 'nope'.*\['default', 'rag', 'tool_use'\]"):
        templates.text_for("nope")
    with pytest.raises(ValueError, match="only named chat templates"):
        ChatTemplates("", {"tool_use": "T"}).text_for()
    assert ChatTemplates("", {"tool_use": "T"}).text_for(tools=WEATHER) == "T"


# --- HF directories -------------------------------------------------------------------------

def _transformers_tokenizer(template: str | dict):
    transformers = pytest.importorskip("transformers")
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("the SmolLM2 model is not converted here")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(SMOLLM2_DIR / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>")
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("jinja_files", [True, False], ids=["transformers5", "legacy_config"])
def test_hf_directory_templates_as_transformers_saves_them(tmp_path: Path, jinja_files: bool) -> None:
    named = {"default": ECHO, "tool_use": "{{ tools[0].function.name }}" + ECHO, "rag": "R" + ECHO}
    reference = _transformers_tokenizer(named)
    reference.save_pretrained(tmp_path, save_jinja_files=jinja_files)
    assert (tmp_path / "chat_template.jinja").is_file() == jinja_files
    assert read_hf_templates(tmp_path) == (ECHO, {"tool_use": named["tool_use"], "rag": named["rag"]})
    ours = TextTokenizer.from_hf_dir(tmp_path)
    messages = [{"role": "user", "content": "Grüße"}]
    for kwargs in ({}, {"tools": WEATHER}, {"chat_template": "rag"}):
        assert ours.apply_chat_template(messages, **kwargs) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_hf_single_template_both_layouts_and_chat_template_json(tmp_path: Path) -> None:
    reference = _transformers_tokenizer(ECHO)
    reference.save_pretrained(tmp_path / "v5")
    reference.save_pretrained(tmp_path / "v4", save_jinja_files=False)
    assert json.loads((tmp_path / "v4" / "tokenizer_config.json").read_text())["chat_template"] == ECHO
    assert read_hf_templates(tmp_path / "v5") == read_hf_templates(tmp_path / "v4") == (ECHO, {})
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert read_hf_templates(tmp_path / "proc") == ("P", {})
    (tmp_path / "proc" / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    (tmp_path / "proc" / "chat_template.json").unlink()
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template must be"):
        read_hf_templates(tmp_path / "proc")
    assert read_hf_templates(tmp_path) == ("", {})


def test_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    reference = _transformers_tokenizer(ECHO)
    reference.save_pretrained(tmp_path)
    eos = reference.convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 0, 7]}))
    assert TextTokenizer.from_hf_dir(tmp_path).eos_ids == [eos, 0, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert generation_eos_ids(tmp_path) == [5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        generation_eos_ids(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert generation_eos_ids(tmp_path) == []


def test_named_templates_survive_save_and_load(tmp_path: Path) -> None:
    reference = _transformers_tokenizer({"default": ECHO, "tool_use": "T" + ECHO})
    reference.save_pretrained(tmp_path / "hf")
    TextTokenizer.from_hf_dir(tmp_path / "hf").save(tmp_path / "ours")
    loaded = TextTokenizer.load(tmp_path / "ours")
    assert loaded.meta["chat_template"] == ECHO and loaded.meta["chat_templates"] == {"tool_use": "T" + ECHO}
    assert loaded.apply_chat_template([], tools=WEATHER) == "T"


# --- GGUF -----------------------------------------------------------------------------------

def test_gguf_default_and_named_templates(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template([{"name": "default", "template": ECHO}, {"name": "tool_use", "template": "T"}])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_templates(gguf.GGUFReader(str(path))) == (ECHO, {"tool_use": "T"})


def test_a_broken_template_fails_at_load_naming_itself() -> None:
    with pytest.raises(TemplateError, match="chat template 'tool_use' does not compile"):
        ChatTemplates(ECHO, {"tool_use": "{% if %}"})


def test_template_variables_parse_the_generation_tag(llama_cpp_models: Path) -> None:
    text = (llama_cpp_models / "templates" / "LFM2.5-8B-A1B.jinja").read_text(encoding="utf-8")
    assert "{%- generation -%}" in text
    variables = meta.find_undeclared_variables(chat_environment().parse(text))   # what it reads from its context
    assert {"messages", "tools", "add_generation_prompt"} <= variables


def test_command_r_vocab_carries_named_templates(llama_cpp_models: Path) -> None:
    default, named = gguf_templates(gguf_template_fields(llama_cpp_models / "ggml-vocab-command-r.gguf"))
    assert sorted(named) == ["rag", "tool_use"] and default.startswith("{{ bos_token }}")
    assert ChatTemplates(default, named).text_for(tools=WEATHER) == named["tool_use"]


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["qwen2", "phi-3"])
def test_hf_directory_saved_from_a_real_vocab_renders_as_transformers(
        vocab: str, llama_cpp_models: Path, tmp_path: Path) -> None:
    """transformers loads llama.cpp's vocab GGUF and saves it (chat_template.jinja); our
    from_hf_dir renders every case as its apply_chat_template does."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        str(llama_cpp_models), gguf_file=f"ggml-vocab-{vocab}.gguf")
    reference.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    ours = TextTokenizer.from_hf_dir(tmp_path)
    outcomes = {}
    for name, case in CASES.items():
        if case.get("when", "") not in reference.chat_template:
            continue
        kwargs = {"tools": case.get("tools"), "documents": case.get("documents"), **case.get("kwargs", {})}
        prompt = case.get("add_generation_prompt", True)
        try:
            expected = reference.apply_chat_template(
                case["messages"], add_generation_prompt=prompt, tokenize=False, **kwargs)
        except TemplateError:  # e.g. Qwen 2.5's template reads the content a tool call lacks
            with pytest.raises(TemplateError):
                ours.apply_chat_template(case["messages"], prompt, **kwargs)
            outcomes[name] = "raises"
            continue
        assert ours.apply_chat_template(case["messages"], prompt, **kwargs) == expected, name
        outcomes[name] = "equal"
    assert list(outcomes.values()).count("equal") >= 10, outcomes
