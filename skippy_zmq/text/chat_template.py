"""Chat templates: the Jinja environment transformers renders them with, and the model's templates.

A model may carry several named templates (`default`, `tool_use`, ...): GGUF keeps
`tokenizer.chat_template` and `tokenizer.chat_template.<name>`; an HF directory
keeps them in `chat_template.jinja` plus `additional_chat_templates/<name>.jinja`
(transformers 5), `chat_template.json` (processors) or `tokenizer_config.json`
(a string, or a list of `{name, template}`). They travel in tokenizer_meta.json as
`chat_template` (the default) and `chat_templates` (name -> text).

The environment and the input handling follow transformers'
`utils/chat_template_utils.py` (`_compile_jinja_template`, `render_jinja_template`)
and `apply_chat_template`, so a template renders byte for byte as it does there.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols

from skippy_zmq.text.template_budget import BudgetedSandbox, RenderBudget, guarded_tree, render_within

DEFAULT = "default"
TOOL_USE = "tool_use"
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"

# Names a message's reasoning comes under; templates read `reasoning_content`, gpt-oss's `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class GenerationBlock(Extension):
    """`{% generation %} ... {% endgeneration %}`: marks the assistant's part for training masks;
    rendering it gives its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=1)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace: {name!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Not Jinja's own tojson: that one escapes HTML characters and takes only `indent`.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# Compiled templates a ChatTemplates keeps; a model declares a handful, so this is never reached
# by the model's own and bounds what anything else could pile up.
MAX_COMPILED = 8


def chat_environment(now: Callable[[], datetime] = datetime.now,
                     budget: RenderBudget = RenderBudget()) -> BudgetedSandbox:
    """transformers' chat-template environment (bounded by `budget`: template_budget); `now` is
    what `strftime_now` formats (tests fix it)."""
    env = BudgetedSandbox(
        budget, trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.seal()


def plain_data(value: Any) -> Any:
    """What a template may see: JSON types rebuilt (subclasses stripped), anything else a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (str enums, ...) lose their extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys whose value is None dropped
    (OpenAI's `content: null` beside tool_calls), reasoning aliased under `reasoning_content`
    and `thinking`."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}]: a message must be an object, got {type(message).__name__}")
        message = plain_data({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled template and how it is rendered, within `budget` (time and size: a render over
    it raises RenderBudgetError, a TemplateError)."""

    def __init__(self, text: str, now: Callable[[], datetime] = datetime.now,
                 budget: RenderBudget = RenderBudget()) -> None:
        self.text = text
        self._env = chat_environment(now, budget)
        self._compiled = self._env.from_string(guarded_tree(self._env, text))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """What transformers' apply_chat_template(tokenize=False) returns for the same inputs;
        `tools` are OpenAI tool dicts (JSON schemas), `kwargs` the request's chat_template_kwargs
        (e.g. enable_thinking). Any failure inside the template is a TemplateError."""
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be a list of objects (title, text)")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TypeError("tools must be a list of objects (JSON schemas)")
        try:
            context = plain_data({"bos_token": bos_token, "eos_token": eos_token, **kwargs})
            variables = dict(messages=template_messages(messages), tools=plain_data(tools),
                             documents=plain_data(documents), add_generation_prompt=add_generation_prompt, **context)
        except RecursionError:
            raise TemplateError("the template's inputs nest too deeply") from None
        try:
            return render_within(self._env, lambda: self._compiled.generate(**variables))
        except TemplateError:
            raise
        except Exception as err:  # a template's own bug (e.g. str + dict): the template failed
            raise TemplateError(f"{type(err).__name__}: {err}") from err


class ChatTemplates:
    """A model's default template and its named ones, all compiled at load. Only these render:
    a name a caller gives must be one of them, never template text."""

    def __init__(self, default: str = "", named: Mapping[str, str] | None = None,
                 now: Callable[[], datetime] = datetime.now, budget: RenderBudget = RenderBudget()) -> None:
        self.default = default
        self.named = {k: v for k, v in (named or {}).items() if k != DEFAULT}
        self._now, self._budget = now, budget
        self._compiled: OrderedDict[str, ChatTemplate] = OrderedDict()   # LRU, MAX_COMPILED at most
        self._lock = threading.Lock()   # requests render in worker threads
        self.check()

    def check(self) -> None:
        """Compile every template now, so a broken one fails at load, naming itself."""
        for name in self.names():
            try:
                self.select(name)
            except TemplateError as err:
                raise TemplateError(f"chat template {name!r} does not compile: {err}") from err

    def __bool__(self) -> bool:
        return bool(self.default or self.named)

    def text_for(self, name: str | None = None, tools: Any = None) -> str:
        """transformers' choice: a requested name; else `tool_use` when there are tools and the
        model has one; else the default. Template text in place of a name is refused (transformers
        renders it; here templates belong to the model)."""
        if name is not None:
            if name == DEFAULT and self.default:
                return self.default
            if name in self.named:
                return self.named[name]
            if "{{" in name or "{%" in name or "{#" in name:
                raise ValueError(f"chat_template: template text is not accepted, only the name of one of "
                                 f"this model's templates ({self.names()})")
            raise ValueError(f"no chat template named {name!r} (this model has: {self.names()})")
        if tools is not None and TOOL_USE in self.named:
            return self.named[TOOL_USE]
        if self.default:
            return self.default
        if self.named:
            raise ValueError(f"this model has only named chat templates {self.names()}: pick one")
        raise ValueError("this model has no chat template (tokenizer.chat_template)")

    @property
    def compiled_count(self) -> int:
        """How many compiled templates are kept (MAX_COMPILED at most)."""
        return len(self._compiled)

    def names(self) -> list[str]:
        return sorted({*self.named, *([DEFAULT] if self.default else [])})

    def select(self, name: str | None = None, tools: Any = None) -> ChatTemplate:
        text = self.text_for(name, tools)
        with self._lock:
            if text in self._compiled:
                self._compiled.move_to_end(text)
                return self._compiled[text]
        template = ChatTemplate(text, self._now, self._budget)   # compiled outside the lock
        with self._lock:
            self._compiled[text] = template
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return template


def _split_named(templates: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    named = {k: v for k, v in templates.items() if k != DEFAULT}
    return templates.get(DEFAULT, ""), named


def _config_templates(value: Any, where: Path) -> dict[str, str]:
    """tokenizer_config.json's / chat_template.json's `chat_template`: a string or a list of
    {name, template}."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {DEFAULT: value}
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}}")


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot be read as JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def read_hf_templates(directory: str | Path) -> tuple[str, dict[str, str]]:
    """An HF directory's templates (default text, name -> text), as transformers 4 and 5 save them:
    `chat_template.jinja` and `additional_chat_templates/*.jinja` first (transformers 5; they
    win over the config, as when transformers loads them), then `chat_template.json`, then
    `tokenizer_config.json`'s `chat_template`."""
    directory = Path(directory)
    templates: dict[str, str] = {}
    jinja_file, extra_dir = directory / "chat_template.jinja", directory / "additional_chat_templates"
    if jinja_file.is_file():
        templates[DEFAULT] = jinja_file.read_text(encoding="utf-8")
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if templates or not (directory / name).is_file():
            continue
        path = directory / name
        templates = _config_templates(_json_file(path).get("chat_template"), path)
    return _split_named(templates)


def gguf_templates(reader: Any) -> tuple[str, dict[str, str]]:
    """A GGUF's templates: `tokenizer.chat_template` (default) and `tokenizer.chat_template.<name>`
    (llama.cpp's converter writes e.g. `tokenizer.chat_template.tool_use`)."""
    templates: dict[str, str] = {}
    for key, field in reader.fields.items():
        if key == GGUF_TEMPLATE_KEY:
            name = DEFAULT
        elif key.startswith(GGUF_TEMPLATE_KEY + "."):
            name = key[len(GGUF_TEMPLATE_KEY) + 1:]
        else:
            continue
        value = field.contents()
        if not isinstance(value, str):
            raise ValueError(f"GGUF field {key}: expected a string, got {type(value).__name__}")
        templates[name] = value
    return _split_named(templates)


def generation_eos_ids(directory: str | Path) -> list[int]:
    """generation_config.json's `eos_token_id` (an int or a list; Llama 3 Instruct ends on
    any of 128001/128008/128009), [] when there is none."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return []
    value = _json_file(path).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return ids


def merge_ids(first: list[int], more: list[int]) -> list[int]:
    """`first` then the ids of `more` it lacks, order kept."""
    return [*first, *(i for i in more if i not in first)]
