"""The JSON schema a required / named tool_choice constrains the output to."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from skippy_zmq.text.tools.validation import FunctionSpec, ToolSet

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


def arguments_for(spec: FunctionSpec, defs: dict[str, Any]) -> dict[str, Any]:
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


def tool_call_schema(toolset: ToolSet, arguments_key: str = "arguments") -> dict[str, Any] | None:
    """The JSON schema of the one call a required / named choice allows; None for auto / none.

    {"name": {"const": f}, arguments_key: f's parameters} for the named
    function, or anyOf such objects over every tool for "required" (the
    object itself when there is one tool). The final stage enforces it with
    the grammar engine on the output after the format's constrained prefix
    (objects the schema leaves open are closed there: constrain.close_objects).
    """
    if not toolset.constrained:
        return None
    defs: dict[str, Any] = {}
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": spec.name}, arguments_key: arguments_for(spec, defs)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for spec in toolset.allowed
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema
