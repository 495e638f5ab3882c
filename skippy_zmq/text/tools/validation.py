"""OpenAI tools: validation of `tools` / `tool_choice` / `parallel_tool_calls` and of chat
messages carrying tool traffic.

* `validate_tools(tools, tool_choice, parallel_tool_calls)` -> `ToolSet`;
* `normalise_messages(messages)` accepts tool traffic: assistant messages with
  `content: null` plus `tool_calls`, and `tool` role messages.

Every error is a `ToolError` (a ValueError) whose message starts with the
path of the offending value, e.g. ``tools[1].function.parameters: must be an
object``; `.param` is the top-level request parameter (``tools``,
``tool_choice``, ``messages``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

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


def arguments_object(arguments: object, path: str) -> dict[str, Any]:
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
    arguments = arguments_object(function.get("arguments"), f"{path}.function.arguments")
    encoded = function["arguments"] if isinstance(function.get("arguments"), str) else dump(arguments)
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
        role = _role(message, path)
        if role == "tool":
            out.append(_tool_message(message, path, open_calls))
            continue
        normal = _calling_message(message, path) if role == "assistant" else None
        if normal is None:
            if message.get("tool_calls") is not None and role != "assistant":
                raise ToolError(f"{path}.tool_calls", f"only assistant messages have tool_calls, not {role}")
            normal = {"role": role, "content": _text(message.get("content"), f"{path}.content")}
        out.append(normal)
        # the calls of this turn are what the tool messages after it may answer
        open_calls = {c["id"]: c["function"]["name"] for c in normal.get("tool_calls", ())} or None
    return out


def _role(message: object, path: str) -> str:
    """The message's role ("developer" read as "system"), once `message` is known to be an object."""
    if not isinstance(message, dict):
        raise ToolError(path, f"must be an object, got {_short(message)}")
    role = message.get("role")
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in MESSAGE_ROLES:
        raise ToolError(f"{path}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {_short(role)}")
    return role


def _tool_message(message: dict[str, Any], path: str, open_calls: dict[str, str] | None) -> dict[str, Any]:
    """A `tool` message, which must answer one of the preceding assistant turn's calls."""
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
    return {"role": "tool", "tool_call_id": call_id, "name": open_calls[call_id],
            "content": _text(message.get("content"), f"{path}.content")}


def _calling_message(message: dict[str, Any], path: str) -> dict[str, Any] | None:
    """An assistant message with tool calls in its normal shape; None when it has none."""
    raw_calls = message.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise ToolError(f"{path}.tool_calls", f"must be a list, got {_short(raw_calls)}")
    if not raw_calls:
        return None
    calls = [_tool_call(raw, f"{path}.tool_calls[{i}]") for i, raw in enumerate(raw_calls)]
    ids = [c["id"] for c in calls]
    duplicate = next((i for i, call_id in enumerate(ids) if call_id in ids[:i]), None)
    if duplicate is not None:
        raise ToolError(f"{path}.tool_calls[{duplicate}].id", f"{ids[duplicate]!r} is used twice")
    content = message.get("content")
    return {"role": "assistant", "content": None if content is None else _text(content, f"{path}.content"),
            "tool_calls": calls}


def dump(value: Any) -> str:
    """JSON as calls and tool lists are written (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)
