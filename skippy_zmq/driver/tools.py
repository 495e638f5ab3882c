"""OpenAI tools: request validation, prompt rendering and tool-call parsing.

Pure functions, no I/O; the server wires them in:

* `validate_tools(tools, tool_choice, parallel_tool_calls)` -> `ToolSet`;
* `normalise_messages(messages)` accepts tool traffic: assistant messages with
  `content: null` plus `tool_calls`, and `tool` role messages;
* `messages_for_template(messages, toolset)` turns that traffic into plain
  `{"role", "content"}` messages any chat template renders, with the tool
  prompt (`render_tool_prompt`) in the system message. This is the generic
  path (SmolLM2's template has no tools); `template_supports_tools` detects a
  template that renders `tools` itself, and `native_template_inputs` gives it
  what HF-style templates expect;
* `parse_tool_calls(text, toolset)` and `ToolCallStream` read
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
  Hermes / Qwen2.5 convention) out of the model's output;
* `tool_call_schema(toolset)` and `constrained_prefix(toolset)`: for
  `required` or a named function, the JSON schema of the one call the final
  stage constrains the output to, after the prefix `<tool_call>\\n`.

Every error is a `ToolError` (a ValueError) whose message starts with the
path of the offending value, e.g. ``tools[1].function.parameters: must be an
object``; `.param` is the top-level request parameter (``tools``,
``tool_choice``, ``messages``).
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICE_MODES = ("auto", "none", "required")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
# The arguments schema of a function declared without `parameters` (OpenAI: "an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A refused tools / tool_choice / messages value; the message starts with its path."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.param = re.split(r"[.\[]", path, maxsplit=1)[0]

    @property
    def message(self) -> str:
        return str(self)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- tools and tool_choice

@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None   # as given; None when omitted
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def to_openai(self) -> dict[str, Any]:
        """The tool in OpenAI's request shape (`strict` left out), as listed in the tool prompt."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSet:
    """Validated `tools` plus `tool_choice`.

    mode is "auto", "none", "required" or "function" (then `name` is the
    forced function). With no tools the mode is "none".
    """

    functions: tuple[FunctionSpec, ...] = ()
    mode: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.functions)

    @property
    def allowed(self) -> tuple[FunctionSpec, ...]:
        """The functions the model may call under this tool_choice."""
        if self.mode == "none":
            return ()
        if self.mode == "function":
            return tuple(f for f in self.functions if f.name == self.name)
        return self.functions

    @property
    def active(self) -> bool:
        """Whether the prompt lists the tools and the output is parsed for calls."""
        return self.mode != "none" and bool(self.functions)

    @property
    def constrained(self) -> bool:
        """Whether the final stage must constrain the output to one call (required / named)."""
        return self.mode in ("required", "function") and bool(self.functions)

    def function(self, name: str) -> FunctionSpec | None:
        return next((f for f in self.functions if f.name == name), None)


NO_TOOLS = ToolSet()
_CHOICE_SHAPES = 'must be "auto", "none", "required" or a named function'


def _check_schema(schema: dict[str, Any], path: str) -> None:
    if "type" in schema and schema["type"] != "object":
        raise ToolError(
            f"{path}.type", f'must be "object" (function arguments are an object), got {_short(schema["type"])}'
        )
    try:
        import jsonschema  # optional: a full meta-schema check where the package is installed
    except ImportError:
        return
    try:   # against 2020-12 whatever "$schema" says: a client's "$schema" value is not trusted
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.path)
        raise ToolError(f"{path}{where}", f"not a valid JSON schema: {err.message}") from None
    except (RecursionError, ValueError, TypeError) as err:
        raise ToolError(path, f"not a valid JSON schema: {type(err).__name__}") from None


def _function_spec(raw: object, index: int) -> FunctionSpec:
    path = f"tools[{index}]"
    if not isinstance(raw, dict):
        raise ToolError(path, f"must be an object, got {_short(raw)}")
    if raw.get("type") != "function":
        raise ToolError(f"{path}.type", f'must be "function", got {_short(raw.get("type"))}')
    function = raw.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{path}.function", f"must be an object, got {_short(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ToolError(f"{path}.function.name", f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {_short(name)}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{path}.function.description", f"must be a string, got {_short(description)}")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ToolError(f"{path}.function.parameters", f"must be an object, got {_short(parameters)}")
        _check_schema(parameters, f"{path}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{path}.function.strict", f"must be a boolean, got {_short(strict)}")
    return FunctionSpec(name, description, parameters, strict)


def validate_tools(tools: object, tool_choice: object = None, parallel_tool_calls: object = None) -> ToolSet:
    """The ToolSet of a request's `tools`, `tool_choice` and `parallel_tool_calls`.

    tool_choice defaults to "auto" with tools and "none" without; an empty
    tools list counts as none; "auto" without tools is accepted (as "none").
    """
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError("tools", f"must be a list of tools, got {_short(tools)}")
    functions = tuple(_function_spec(raw, index) for index, raw in enumerate(tools))
    seen: dict[str, int] = {}
    for index, spec in enumerate(functions):
        if spec.name in seen:
            raise ToolError(
                f"tools[{index}].function.name", f"{spec.name!r} is already the name of tools[{seen[spec.name]}]"
            )
        seen[spec.name] = index
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", f"must be a boolean, got {_short(parallel_tool_calls)}")
    parallel = parallel_tool_calls is not False

    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICE_MODES:
            raise ToolError("tool_choice", f"{_CHOICE_SHAPES}, got {tool_choice!r}")
        if tool_choice == "required" and not functions:
            raise ToolError("tool_choice", '"required" needs at least one tool in tools')
        return ToolSet(functions, tool_choice if functions else "none", None, parallel)
    if not isinstance(tool_choice, dict):
        raise ToolError("tool_choice", f"{_CHOICE_SHAPES}, got {_short(tool_choice)}")
    if tool_choice.get("type") != "function":
        raise ToolError("tool_choice.type", f'must be "function", got {_short(tool_choice.get("type"))}')
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ToolError("tool_choice.function", f"must be an object with a name, got {_short(function)}")
    name = function.get("name")
    if not isinstance(name, str):
        raise ToolError("tool_choice.function.name", f"must be a string, got {_short(name)}")
    if name not in seen:
        listed = ", ".join(seen) or "no tools given"
        raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools ({listed})")
    return ToolSet(functions, "function", name, parallel)


# ---------------------------------------------------------------- messages

def _text(content: object, path: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(part["text"] for part in content)  # vLLM joins text parts the same way
    raise ToolError(path, f'must be a string or a list of {{"type": "text", "text": ...}} parts, got {_short(content)}')


def _arguments_object(arguments: object, path: str) -> dict[str, Any]:
    """The arguments of a call in a request: a JSON string (OpenAI) or an object (tolerated)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            return value
    raise ToolError(path, f"must be a string holding a JSON object, got {_short(arguments)}")


def _tool_call(raw: object, path: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ToolError(path, f"must be an object, got {_short(raw)}")
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolError(f"{path}.id", f"must be a non-empty string, got {_short(call_id)}")
    if raw.get("type", "function") != "function":
        raise ToolError(f"{path}.type", f'must be "function", got {_short(raw.get("type"))}')
    function = raw.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{path}.function", f"must be an object, got {_short(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{path}.function.name", f"must be a non-empty string, got {_short(name)}")
    arguments = _arguments_object(function.get("arguments"), f"{path}.function.arguments")
    encoded = function["arguments"] if isinstance(function.get("arguments"), str) else _dump(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": encoded}}


def normalise_messages(messages: object) -> list[dict[str, Any]]:
    """Validated chat messages, tool traffic included, in one shape.

    * system / user / plain assistant: ``{"role", "content": str}`` (exactly what
      the server rendered before tools, so those prompts are unchanged);
      "developer" becomes "system";
    * assistant with tool calls: ``{"role": "assistant", "content": str | None,
      "tool_calls": [{"id", "type": "function", "function": {"name",
      "arguments": str}}]}``; content may be null or absent only here;
    * tool: ``{"role": "tool", "tool_call_id", "name", "content": str}``; it
      must follow (directly, or after other tool messages) an assistant message
      whose tool_calls hold that id; `name` is that call's function.
    """
    if not isinstance(messages, list) or not messages:
        raise ToolError("messages", "must be a non-empty list")
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] | None = None   # id -> function name of the assistant turn being answered
    for index, message in enumerate(messages):
        path = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ToolError(path, f"must be an object, got {_short(message)}")
        role = message.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in MESSAGE_ROLES:
            raise ToolError(f"{path}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {_short(role)}")
        content = message.get("content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ToolError(f"{path}.tool_call_id", f"must be a non-empty string, got {_short(call_id)}")
            if open_calls is None:
                raise ToolError(f"{path}.role", '"tool" messages must follow an assistant message with tool_calls')
            if call_id not in open_calls:
                known = ", ".join(open_calls)
                raise ToolError(
                    f"{path}.tool_call_id",
                    f"{call_id!r} is not one of the preceding assistant message's tool_calls ({known})",
                )
            out.append({"role": "tool", "tool_call_id": call_id, "name": open_calls[call_id],
                        "content": _text(content, f"{path}.content")})
            continue
        open_calls = None
        raw_calls = message.get("tool_calls") if role == "assistant" else None
        if raw_calls is not None and not isinstance(raw_calls, list):
            raise ToolError(f"{path}.tool_calls", f"must be a list, got {_short(raw_calls)}")
        if raw_calls:
            calls = [_tool_call(raw, f"{path}.tool_calls[{i}]") for i, raw in enumerate(raw_calls)]
            ids = [c["id"] for c in calls]
            duplicate = next((i for i, call_id in enumerate(ids) if call_id in ids[:i]), None)
            if duplicate is not None:
                raise ToolError(f"{path}.tool_calls[{duplicate}].id", f"{ids[duplicate]!r} is used twice")
            out.append({"role": "assistant", "content": None if content is None else _text(content, f"{path}.content"),
                        "tool_calls": calls})
            open_calls = {c["id"]: c["function"]["name"] for c in calls}
            continue
        if role != "assistant" and message.get("tool_calls") is not None:
            raise ToolError(f"{path}.tool_calls", f"only assistant messages have tool_calls, not {role}")
        out.append({"role": role, "content": _text(content, f"{path}.content")})
    return out


# ---------------------------------------------------------------- rendering

def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tool_prompt(toolset: ToolSet) -> str:
    """The tool section of the system prompt ("" when no tools are active).

    Qwen2.5's wording: the functions as JSON lines in <tools></tools>, then
    how to answer with a call. Only the functions the choice allows are listed.
    """
    allowed = toolset.allowed if toolset.active else ()
    if not allowed:
        return ""
    listed = "\n".join(_dump(spec.to_openai()) for spec in allowed)
    if toolset.mode == "function":
        rule = f'You must call the function "{toolset.name}".'
    elif toolset.mode == "required":
        rule = "You must call one of these functions." if not toolset.parallel else \
            "You must call one or more of these functions."
    else:
        rule = "You may call one of these functions to assist with the user query." if not toolset.parallel else \
            "You may call one or more functions to assist with the user query."
    return (
        f"# Tools\n\n{rule}\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        f"For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def format_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One call as the model is told to write it: <tool_call>\\n{json}\\n</tool_call>."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    return f"{TOOL_CALL_OPEN}\n{_dump({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def messages_for_template(
    messages: Iterable[Mapping[str, Any]],
    toolset: ToolSet | None = None,
    tool_role: str = "user",
    default_system: str | None = None,
) -> list[dict[str, str]]:
    """Normalised messages (tool traffic included) as plain {"role", "content"} messages.

    * an assistant message with tool_calls -> assistant content: its text (if
      any), then each call as a <tool_call> block, joined by newlines;
    * a run of consecutive tool messages -> ONE `tool_role` message (default
      "user", as Qwen2.5's template does: it keeps user/assistant alternation
      for templates that enforce it) holding each result in a
      <tool_response>\\n...\\n</tool_response> block, joined by newlines;
    * with active tools, the tool prompt goes at the end of the first system
      message (after a blank line), or becomes a new first system message
      (`default_system`, if given, before it). The template's own default
      system prompt (SmolLM2's "You are a helpful AI assistant named SmolLM")
      is then not rendered, as with any client-given system message.

    Plain messages and no active tools: the messages unchanged.
    """
    out: list[dict[str, str]] = []
    previous_tool = False
    for message in messages:
        role, content = message["role"], message.get("content")
        if role == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
            if previous_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": tool_role, "content": block})
            previous_tool = True
            continue
        previous_tool = False
        if role == "assistant" and message.get("tool_calls"):
            parts = [content] if content else []
            parts += [format_tool_call(c["function"]["name"], c["function"]["arguments"])
                      for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
            continue
        out.append({"role": role, "content": content if content is not None else ""})
    prompt = render_tool_prompt(toolset) if toolset is not None else ""
    if prompt:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": f"{default_system}\n\n{prompt}" if default_system else prompt})
    return out


def template_supports_tools(template_text: str) -> bool:
    """Whether a Jinja chat template renders a `tools` variable itself (Qwen2.5, Llama 3.1, Hermes...).

    Such a template gets `tools=` at render time (see native_template_inputs)
    instead of the generic prompt. Reads the template's free variables; falls
    back to a word search if the template does not parse.
    """
    if not template_text:
        return False
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(template_text))
    except TemplateSyntaxError:
        return re.search(r"\btools\b", template_text) is not None


def native_template_inputs(
    messages: Iterable[Mapping[str, Any]], toolset: ToolSet | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for a template that renders tools itself (HF convention).

    Call arguments become objects (HF templates write them with `| tojson`;
    vLLM does the same conversion); tools are the allowed tools in OpenAI's
    shape, or None when no tools are active.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**c, "function": {"name": c["function"]["name"],
                                   "arguments": _arguments_object(c["function"]["arguments"], "arguments")}}
                for c in message["tool_calls"]
            ]
        out.append(message)
    tools = [spec.to_openai() for spec in toolset.allowed] if toolset is not None and toolset.active else None
    return out, tools


# ---------------------------------------------------------------- parsing

def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str   # a JSON object, serialised

    def to_openai(self) -> dict[str, Any]:
        """As in `choices[].message.tool_calls[]`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self, index: int) -> dict[str, Any]:
        """As in `choices[].delta.tool_calls[]`: the whole call in one delta."""
        return {"index": index, **self.to_openai()}


def _call_from_json(value: object, toolset: ToolSet | None, new_id: Callable[[], str]) -> ToolCall | None:
    """A call from a decoded {"name", "arguments"} object; None if it is not one (or not allowed)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" in value:
        arguments = value["arguments"]
    else:
        arguments = value.get("parameters", {})   # Llama 3.1's spelling
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    if toolset is not None and value["name"] not in {f.name for f in toolset.allowed}:
        return None   # a call to a function the request does not offer stays text
    return ToolCall(new_id(), value["name"], _dump(arguments))


def _decode_block(inner: str, toolset: ToolSet | None, new_id: Callable[[], str]) -> ToolCall | None:
    try:
        value = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    return _call_from_json(value, toolset, new_id)


def _bare_calls(text: str, toolset: ToolSet, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls of a bare JSON answer (an object or a list of them), or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_json(item, toolset, new_id) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls if toolset.parallel else calls[:1]


def parse_tool_calls(
    text: str, toolset: ToolSet | None = None, new_id: Callable[[], str] = new_call_id
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output.

    Each `<tool_call>JSON</tool_call>` block whose JSON is {"name": str,
    "arguments": object (or a string holding one)} is a call; a last block
    left unclosed at the end counts too if its JSON is whole. A block that does
    not decode (bad JSON, no name, a function the toolset does not allow)
    stays in the content, tags and all. With `parallel` off, blocks after the
    first call are dropped. Content: the text outside the calls, with the
    whitespace just before each call dropped, and leading whitespace dropped
    where only calls came before; None when there are calls and no other
    text; the text itself when there are none. For required / named choices
    a bare JSON answer (a call object or a list of them) is also read as calls.
    """
    if toolset is not None and toolset.constrained and TOOL_CALL_OPEN not in text:
        bare = _bare_calls(text.strip(), toolset, new_id)
        if bare is not None:
            return None, bare
    content, calls, position = "", [], 0
    after_call = False
    cursor = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, cursor)
        if start < 0:
            break
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        inner = text[start + len(TOOL_CALL_OPEN): end if end >= 0 else len(text)]
        block_end = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(text)
        call = _decode_block(inner, toolset, new_id)
        if call is None:
            cursor = block_end
            if end < 0:
                break
            continue
        segment = text[position:start]
        if after_call and not content:
            segment = segment.lstrip()
        content += segment.rstrip()
        if toolset is None or toolset.parallel or not calls:
            calls.append(call)
        after_call, position = True, block_end
        cursor = block_end
    if not calls:
        return text, []
    segment = text[position:]
    if not content:
        segment = segment.lstrip()
    content += segment
    return content or None, calls


def finish_reason(reason: str | None, calls: list[ToolCall] | int) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the output made calls and stopped on its own."""
    count = calls if isinstance(calls, int) else len(calls)
    return "tool_calls" if count and reason == "stop" else reason


def _partial_open(buffer: str) -> int:
    """Length of the longest suffix of buffer that is a proper prefix of <tool_call>."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(buffer)), 0, -1):
        if buffer.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0


@dataclass
class ToolCallStream:
    """Streamed text in, OpenAI `delta` objects out; reassembles to parse_tool_calls.

    push(text) and, at the end, flush() return lists of deltas, each either
    ``{"content": str}`` or ``{"tool_calls": [{"index", "id", "type":
    "function", "function": {"name", "arguments"}}]}``. A call is sent whole,
    in one delta, once its block closes (its JSON is checked first, so a bad
    block can still go out as text). Text that might be the start of
    <tool_call>, a block not yet closed, and whitespace that might precede a
    call are held back. Concatenating the content deltas gives
    parse_tool_calls' content ("" for None) and the tool-call deltas give its
    calls, for any split of the text into pieces. For required / named
    choices an output starting with "{" or "[" (a bare JSON answer) is held
    whole until flush().
    """

    toolset: ToolSet | None = None
    new_id: Callable[[], str] = new_call_id
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._buffer = ""          # outside a block: undecided text; inside: the block so far
        self._inside = False
        self._pending_ws = ""      # trailing whitespace held in case a call follows it
        self._emitted = False      # whether any content has gone out
        self._after_call = False
        self._bare: bool | None = None if self.toolset is not None and self.toolset.constrained else False
        self._done = False

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def push(self, text: str) -> list[dict[str, Any]]:
        if self._done:
            raise RuntimeError("ToolCallStream: push after flush")
        self._buffer += text
        if self._bare is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self._bare = stripped[0] in "{["
        if self._bare:
            return []
        return self._drain()

    def flush(self) -> list[dict[str, Any]]:
        if self._done:
            return []
        self._done = True
        out: list[dict[str, Any]] = []
        if self._bare:
            content, calls = parse_tool_calls(self._buffer, self.toolset, self.new_id)
            if content:
                out.append({"content": content})
            for call in calls:
                out.append(self._emit_call(call))
            return out
        out += self._drain()
        if self._inside:
            call = _decode_block(self._buffer, self.toolset, self.new_id)
            if call is not None:
                out += self._call(call)
            else:
                out += self._content(TOOL_CALL_OPEN + self._buffer)
        else:
            out += self._content(self._buffer)
        self._buffer = ""
        if self._pending_ws:
            out.append({"content": self._pending_ws})
            self._pending_ws = ""
        return out

    def _drain(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if not self._inside:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_open(self._buffer)
                    out += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._inside = True
            end = self._buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return out
            inner, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE):]
            self._inside = False
            call = _decode_block(inner, self.toolset, self.new_id)
            if call is None:
                out += self._content(TOOL_CALL_OPEN + inner + TOOL_CALL_CLOSE)
            else:
                out += self._call(call)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self._after_call and not self._emitted:
            text = text.lstrip()
        if not text:
            return []
        combined = self._pending_ws + text
        body = combined.rstrip()
        self._pending_ws = combined[len(body):]
        if not body:
            return []
        self._emitted = True
        return [{"content": body}]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        self._pending_ws = ""
        self._after_call = True
        if self.toolset is not None and not self.toolset.parallel and self.calls:
            return []
        return [self._emit_call(call)]

    def _emit_call(self, call: ToolCall) -> dict[str, Any]:
        self.calls.append(call)
        return {"tool_calls": [call.to_delta(len(self.calls) - 1)]}


# ---------------------------------------------------------------- constraint for required / named

def constrained_prefix(toolset: ToolSet) -> str:
    """Text the output starts with when the call is constrained ("" otherwise).

    The server appends it to the rendered prompt (after the generation
    prompt) so the model writes only the JSON of `tool_call_schema`, and puts
    it back in front of the output before parsing (parse_tool_calls /
    ToolCallStream accept the block left unclosed at the end).
    """
    return f"{TOOL_CALL_OPEN}\n" if toolset.constrained else ""


_REF_PREFIXES = ("#/$defs/", "#/definitions/")


def _refs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _rewrite_refs(node: Any, rewrite: Callable[[str], str]) -> Any:
    if isinstance(node, dict):
        return {key: rewrite(value) if key == "$ref" and isinstance(value, str) else _rewrite_refs(value, rewrite)
                for key, value in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(value, rewrite) for value in node]
    return node


def _arguments_for(spec: FunctionSpec, defs: dict[str, Any]) -> dict[str, Any]:
    """The function's arguments schema, placed under a root that is not its own.

    Local refs ("#/...") would point at the wrong root once the schema sits
    under properties.arguments: its $defs / definitions move to the root $defs
    as "<function>__<name>"; any other local ref moves the whole schema into
    $defs["<function>__root"] and points there.
    """
    schema = copy.deepcopy(spec.arguments_schema)
    schema.pop("$schema", None)
    local = [ref for ref in _refs(schema) if ref.startswith("#")]
    if not local:
        return schema
    prefix = f"{spec.name}__"
    if all(ref.startswith(_REF_PREFIXES) for ref in local):
        def move(ref: str) -> str:
            for old in _REF_PREFIXES:
                if ref.startswith(old):
                    return "#/$defs/" + prefix + ref[len(old):]
            return ref
        for key in ("$defs", "definitions"):
            for name, sub in (schema.pop(key, None) or {}).items():
                defs[prefix + name] = _rewrite_refs(sub, move)
        return _rewrite_refs(schema, move)
    root = prefix + "root"
    defs[root] = _rewrite_refs(
        schema, lambda ref: f"#/$defs/{root}{ref[1:]}" if ref.startswith("#") else ref
    )
    return {"$ref": f"#/$defs/{root}"}


def tool_call_schema(toolset: ToolSet) -> dict[str, Any] | None:
    """The JSON schema of the one call a required / named choice allows; None for auto / none.

    {"name": {"const": f}, "arguments": f's parameters} for the named
    function, or anyOf such objects over every tool for "required" (the
    object itself when there is one tool). The final stage enforces it with
    the grammar engine on the output after `constrained_prefix`.
    """
    if not toolset.constrained:
        return None
    defs: dict[str, Any] = {}
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": spec.name}, "arguments": _arguments_for(spec, defs)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for spec in toolset.allowed
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema
