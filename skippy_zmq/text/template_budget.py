"""Bounds on rendering a chat template: a time budget and an output-size budget.

Jinja's sandbox stops attribute escapes but bounds no work: `{{ 'x' * 3000000000 }}` asks for
3 GB in one C call, nested `range(100000)` loops run for hours, a macro can call itself
exponentially. A template here is the model's own (a request cannot send one), but messages drive
its loops and recursion, so every render runs under a `RenderBudget`:

* each operation that can build a large value in one step (`*`, `+`, `%` and `**`; `center`,
  `ljust`, `replace`, `format`, ...; the `indent`, `format`, `replace`, `batch`, ... filters) is
  checked *before* it runs: what it would build must fit in the output budget;
* every loop iteration, call, attribute or item access and output chunk checks the deadline, so a
  render over its time stops by itself (the worker thread it runs in is then free again);
* the output is counted as it is produced.

Any of these raises RenderBudgetError (a TemplateError), which the server turns into a 400.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# `indent` / `tojson(indent=...)` beyond this is no real template's need; it multiplies every line.
MAX_INDENT = 64
# `**` results beyond this many bits (a few thousand digits) are refused: bignum powers are CPU bombs.
MAX_POWER_BITS = 1 << 16
_LOOP_GUARD = "__skippy_loop_budget"
_TEXT_GUARD = "__skippy_text_budget"
_WIDTHS = re.compile(r"%[-#0 +]*(\d+)(?:\.(\d+))?")   # printf widths and precisions
_FIELDS = re.compile(r"\{[^{}]*\}")                    # str.format replacement fields


@dataclass(frozen=True)
class RenderBudget:
    """How long one render may take and how many characters it (or any one value in it) may build."""

    seconds: float = 2.0
    max_chars: int = 8 * 1024 * 1024


class RenderBudgetError(TemplateError):
    """A render went over its budget (time or size)."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _format_size(fmt: str, args: Any) -> int:
    """What printf-style `fmt % args` can build, at most: the text, every width and every argument."""
    args = args if isinstance(args, tuple) else (args,)
    widths = sum(int(w) + int(p or 0) for w, p in _WIDTHS.findall(fmt))
    star_args = sum(a for a in args if _is_int(a) and a > 0)   # `%*s` takes its width from the args
    return len(fmt) + widths + star_args + sum(_size(a) for a in args)


def _brace_format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """What `fmt.format(...)` can build, at most: widths inside the fields plus the arguments."""
    widths = sum(int(d) for field in _FIELDS.findall(fmt) for d in re.findall(r"\d+", field.split(":", 1)[-1])
                 if ":" in field)
    return len(fmt) + widths + sum(_size(a) for a in (*args, *kwargs.values()))


def _replace_size(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return _size(s)
    hits = s.count(old) if old else len(s) + 1
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _indent_size(s: Any, width: Any) -> int:
    step = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    if step > MAX_INDENT:
        return 1 << 62   # refused whatever the text
    return _size(s) + (str(s).count("\n") + 1) * step


def _tojson_size(args: tuple, kwargs: dict) -> int:
    indent = _arg(args, kwargs, 2, "indent")
    step = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
    return 1 << 62 if step > MAX_INDENT else 0


# filter name -> what it would build, from its arguments after any Jinja pass-arg.
_FILTER_SIZES: dict[str, Callable[[tuple, dict], int]] = {
    "center": lambda a, k: _arg(a, k, 1, "width", 80),
    "indent": lambda a, k: _indent_size(a[0] if a else "", _arg(a, k, 1, "width", 4)),
    "format": lambda a, k: _format_size(str(a[0]), tuple(a[1:])) + sum(_size(v) for v in k.values()),
    "replace": lambda a, k: _replace_size(*a[:3], _arg(a, k, 3, "count")) if len(a) >= 3 else 0,
    "wordwrap": lambda a, k: _size(a[0] if a else "") * (1 + len(str(_arg(a, k, 4, "wrapstring") or "\n"))),
    "batch": lambda a, k: _arg(a, k, 1, "linecount", 0),
    "slice": lambda a, k: _arg(a, k, 1, "slices", 0),
    "join": lambda a, k: (_size(a[0]) * len(str(_arg(a, k, 1, "d", "")))) if a else 0,
    "tojson": _tojson_size,
    "truncate": lambda a, k: _size(_arg(a, k, 3, "end", "")),
}

def _lipsum_size(args: tuple, kwargs: dict) -> int:
    paragraphs, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
    return paragraphs * most * 12 if _is_int(paragraphs) and _is_int(most) else 0


# str method name -> what it would build, from (the string, args, kwargs).
_METHOD_SIZES: dict[str, Callable[[str, tuple, dict], int]] = {
    "center": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "ljust": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "rjust": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "zfill": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "expandtabs": lambda s, a, k: len(s) * max(_arg(a, k, 0, "tabsize", 8), 1),
    "replace": lambda s, a, k: _replace_size(s, *a[:2], _arg(a, k, 2, "count")) if len(a) >= 2 else 0,
    "format": lambda s, a, k: _brace_format_size(s, a, k),
    "format_map": lambda s, a, k: _brace_format_size(s, (), a[0] if a and isinstance(a[0], dict) else {}),
    "join": lambda s, a, k: len(s) * _size(a[0]) if a else 0,
}


class _LoopGuards(NodeTransformer):
    """Every `for` iterates through the loop guard; every `~` result passes the text guard."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return nodes.Call(nodes.Name(_TEXT_GUARD, "load"), [node], [], None, None, lineno=node.lineno)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with every amplifying operation sized and a deadline inside the loops.

    The deadline of the render in progress is per thread (renders of one compiled template may run
    in several worker threads at once); outside a render only the size checks apply."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, budget: RenderBudget, **options: Any) -> None:
        super().__init__(**options)
        self.budget = budget
        self._render = threading.local()
        self.globals[_LOOP_GUARD] = self._loop_guard
        self.globals[_TEXT_GUARD] = self._text_guard

    def seal(self) -> BudgetedSandbox:
        """Wrap every filter (and `lipsum`) in its checks; call once, after the last filter is added."""
        self.globals["lipsum"] = self._sized("lipsum", _lipsum_size, self.globals["lipsum"], skip_value=False)
        for name, filter_ in list(self.filters.items()):
            self.filters[name] = self._sized(name, _FILTER_SIZES.get(name), filter_)
        return self

    # ---- the render in progress

    def start(self) -> None:
        self._render.deadline = time.monotonic() + self.budget.seconds

    def finish(self) -> None:
        self._render.deadline = None

    def check_time(self) -> None:
        deadline = getattr(self._render, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise RenderBudgetError(f"the chat template ran past its time budget of {self.budget.seconds:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.budget.max_chars:
            raise RenderBudgetError(f"the chat template would build {size} characters with {what}; "
                                    f"the limit is {self.budget.max_chars}")

    # ---- guards the compiled template calls

    def _loop_guard(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.check_time()
            yield item

    def _text_guard(self, text: Any) -> Any:
        self.check_size(_size(text), "~")
        return text

    def _sized(self, name: str, size_of: Callable[[tuple, dict], int] | None, func: Callable[..., Any],
               skip_value: bool = True) -> Callable[..., Any]:
        """`func` checking the deadline, and (`size_of` given) what it would build, before it runs:
        its size estimate and every integer argument but the filtered value itself."""
        skip = 1 if hasattr(func, "jinja_pass_arg") else 0   # eval context / environment first

        @functools.wraps(func)   # keeps jinja_pass_arg
        def sized(*args: Any, **kwargs: Any) -> Any:
            self.check_time()
            if size_of is not None:
                values = args[skip:]
                ints = [v for v in (*values[1 if skip_value else 0:], *kwargs.values()) if _is_int(v)]
                self.check_size(max([size_of(values, kwargs), *ints]), f"{name}()")
            return func(*args, **kwargs)

        return sized

    # ---- the sandbox's hooks

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.check_time()
        if operator == "*":
            seq, count = (left, right) if _is_int(right) else (right, left)
            if isinstance(seq, (str, list, tuple)) and _is_int(count):
                self.check_size(len(seq) * count, "*")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            self.check_size(len(left) + len(right), "+")
        elif operator == "%" and isinstance(left, str):
            self.check_size(_format_size(left, right), "%")
        elif operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > MAX_POWER_BITS:
                raise RenderBudgetError(f"the chat template would compute a {right * abs(left).bit_length()}-bit "
                                        f"number with **; the limit is {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's)
        __self.check_time()
        # the sandbox hands templates str.format wrapped (functools.update_wrapper): look through it
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        size_of = _METHOD_SIZES.get(getattr(__obj, "__name__", "")) if isinstance(owner, str) else None
        if size_of is not None:
            ints = [v for v in (*args, *kwargs.values()) if _is_int(v)]
            __self.check_size(max([size_of(owner, args, kwargs), *ints]), f"str.{__obj.__name__}")
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check_time()
        return super().getitem(obj, argument)


def guarded_tree(env: BudgetedSandbox, text: str) -> nodes.Template:
    """The template's syntax tree with the loop and text guards in place, ready to compile."""
    return _LoopGuards().visit(env.parse(text))


def render_within(env: BudgetedSandbox, chunks: Callable[[], Iterable[str]]) -> str:
    """Join a render's output chunks under the environment's budget (deadline and size)."""
    env.start()
    try:
        out, size = [], 0
        for chunk in chunks():
            size += len(chunk)
            env.check_size(size, "its output")
            env.check_time()
            out.append(chunk)
        return "".join(out)
    finally:
        env.finish()
