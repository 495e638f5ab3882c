"""Compare grammar engines for structured output on this CPU: compile time and per-token mask time.

For each library (llguidance, xgrammar, outlines-core; whichever are installed) and each
constraint (JSON object mode, five JSON schemas, a small GBNF/Lark grammar) it measures the
compile time from a fresh compiler (no cache), then walks a valid output token by token (our
SmolLM2 tokenizer's own BPE ids) timing the mask computation before each token. It prints a
table and writes bench-out/constrain.json.

    .venv/bin/python scripts/bench_constrain.py [--model-dir models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from skippy_zmq.text.tokenizer import TextTokenizer, _byte_level_table

# The test suite's schemas (bounded numbers and strings, so a walk ends).
SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parent.parent / "tests" / "fixtures" / "json_schemas.json").read_text())

EXAMPLES: dict[str, object] = {
    "json_object": {"title": "Pipeline report", "stages": 3, "ok": True,
                    "latency_ms": [12.5, 13.1], "owner": {"team": "infra", "oncall": None}},
    "flat": {"name": "Ada Lovelace", "age": 36, "score": 97.5, "active": True},
    "nested": {"user": {"name": "Grace", "address": {"city": "Arlington",
                                                     "geo": {"lat": 38.88, "lon": -77.1}}}},
    "enum": {"color": "green", "size": "XL", "level": 2},
    "array_of_objects": {"items": [{"id": 1, "tags": ["a", "b"]}, {"id": 22, "tags": []},
                                   {"id": 333, "tags": ["long tag"]}]},
    "required_optional": {"id": 7, "email": "ada@example.com", "note": None},
}

GBNF = r'''root ::= answer
answer ::= "yes" | "no" | list
list ::= "[" item ("," " "? item)* "]"
item ::= [a-z]+ | [0-9]+
'''
LARK = r'''start: answer
answer: "yes" | "no" | list
list: "[" item ("," " "? item)* "]"
item: /[a-z]+/ | /[0-9]+/
'''
GRAMMAR_TEXT = "[apple, 42, banana, 7, kiwi]"


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: TextTokenizer) -> None:
        import llguidance
        import llguidance.numpy as lln
        self._llg, self._lln = llguidance, lln
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=tokenizer.eos_ids)
        self.tokenizer_ms = _ms(t0)
        self.bitmask = lln.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, kind: str, value):
        llg = self._llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(value)
        else:
            grammar = llg.grammar_from("gbnf" if kind == "gbnf" else "lark", value)
        matcher = llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher) -> None:
        self._lln.fill_next_token_bitmask(matcher, self.bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: TextTokenizer) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self._xgr = xgrammar
        t0 = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer)
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=tokenizer.vocab_size, stop_token_ids=tokenizer.eos_ids)
        self.tokenizer_ms = _ms(t0)
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, kind: str, value):
        # A fresh compiler with its cache off, so each compile is a cold one.
        compiler = self._xgr.GrammarCompiler(self.info, cache_enabled=False, max_threads=2)
        if kind == "json" and value == {"type": "object"}:
            compiled = compiler.compile_builtin_json_grammar()
        elif kind == "json":
            compiled = compiler.compile_json_schema(value)
        elif kind == "gbnf":
            compiled = compiler.compile_grammar(value)
        else:
            compiled = compiler.compile_lark(value)
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer: TextTokenizer) -> None:
        import outlines_core
        self._oc = outlines_core
        t0 = time.perf_counter()
        table = _byte_level_table()
        eos = tokenizer.eos_ids[0]
        special = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values()}
        vocab: dict[bytes, list[int]] = {}
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.token_text(token_id)
            if token_id == eos:
                continue
            raw = text.encode() if text in special else bytes(table[c] for c in text)
            vocab.setdefault(raw, []).append(token_id)
        self.vocab = outlines_core.Vocabulary(eos, vocab)
        self.tokenizer_ms = _ms(t0)
        self.vocab_size = tokenizer.vocab_size
        self.mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def compile(self, kind: str, value):
        if kind != "json":
            raise NotImplementedError("regex only: no GBNF/Lark")
        regex = self._oc.json_schema.build_regex_from_schema(json.dumps(value))
        return self._oc.Guide(self._oc.Index(regex, self.vocab))

    def fill(self, guide) -> None:
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, self.mask.itemsize)

    def accept(self, guide, token: int) -> bool:
        guide.advance(token)
        return True


def _cases() -> list[tuple[str, str, object, str]]:
    """(case name, kind, constraint value, a valid output text)."""
    cases = [("json_object", "json", {"type": "object"}, json.dumps(EXAMPLES["json_object"]))]
    cases += [(name, "json", SCHEMAS[name], json.dumps(EXAMPLES[name])) for name in SCHEMAS if name in EXAMPLES]
    cases += [("grammar_gbnf", "gbnf", GBNF, GRAMMAR_TEXT), ("grammar_lark", "lark", LARK, GRAMMAR_TEXT)]
    return cases


def _walk(lib, matcher, tokens: list[int]) -> tuple[list[float], list[float]]:
    mask_us, accept_us = [], []
    for token in tokens:
        t0 = time.perf_counter()
        lib.fill(matcher)
        t1 = time.perf_counter()
        if not lib.accept(matcher, token):
            raise ValueError(f"token {token} refused")
        mask_us.append((t1 - t0) * 1e6)
        accept_us.append((time.perf_counter() - t1) * 1e6)
    return mask_us, accept_us


def bench_library(lib, tokenizer: TextTokenizer, repeats: int) -> dict:
    rows, all_mask = {}, []
    for case, kind, value, text in _cases():
        tokens = tokenizer.encode(text, add_bos=False)
        try:
            compile_ms = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                matcher = lib.compile(kind, value)
                compile_ms.append(_ms(t0))
            mask_us, accept_us = _walk(lib, matcher, tokens)
        except Exception as exc:  # noqa: BLE001 - a library refusing a case is a result
            rows[case] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        all_mask += mask_us[1:]  # the first mask of a walk includes lazy lexer set-up
        rows[case] = {"compile_ms": statistics.median(compile_ms), "tokens": len(tokens),
                      "first_mask_us": mask_us[0], "mask_p50_us": _pct(mask_us, 50),
                      "mask_p99_us": _pct(mask_us, 99), "accept_p50_us": _pct(accept_us, 50)}
    return {"tokenizer_ms": lib.tokenizer_ms, "cases": rows,
            "mask_p50_us": _pct(all_mask, 50), "mask_p99_us": _pct(all_mask, 99)}


def bench_matcher(tokenizer: TextTokenizer, model_dir: str) -> dict:
    """Our Matcher on top of llguidance, per token: apply (mask + -inf into float32 logits) and advance."""
    from skippy_zmq.sampling import mask_logits
    from skippy_zmq.text.constrain import ConstraintSpec, Matcher, tokenizer_info
    info = tokenizer_info(model_dir)
    apply_us, advance_us = [], []
    logits = np.zeros(info.vocab_size, dtype=np.float32)
    for case, kind, value, text in _cases():
        if kind != "json":
            continue
        spec = (ConstraintSpec("json_object") if case == "json_object"
                else ConstraintSpec("json_schema", value))
        matcher = Matcher(spec, info)
        for token in tokenizer.encode(text, add_bos=False):
            t0 = time.perf_counter()
            mask_logits(logits, matcher.mask())
            t1 = time.perf_counter()
            matcher.advance(token)
            apply_us.append((t1 - t0) * 1e6)
            advance_us.append((time.perf_counter() - t1) * 1e6)
    return {"apply_p50_us": _pct(apply_us, 50), "apply_p99_us": _pct(apply_us, 99),
            "advance_p50_us": _pct(advance_us, 50), "advance_p99_us": _pct(advance_us, 99),
            "mask_mean_us": info.mask_stats.mean_us}


def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def print_table(results: dict) -> None:
    libs = list(results["libraries"])
    print(f"{'case':<20}" + "".join(f"{lib + ' compile ms':>26}{'mask p50/p99 us':>20}" for lib in libs))
    for case, *_ in _cases():
        line = f"{case:<20}"
        for lib in libs:
            row = results["libraries"][lib]["cases"].get(case, {})
            if "error" in row:
                line += f"{'n/a':>26}{'n/a':>20}"
            else:
                line += f"{row['compile_ms']:>26.2f}{row['mask_p50_us']:>11.1f}/{row['mask_p99_us']:<8.1f}"
        print(line)
    for lib in libs:
        data = results["libraries"][lib]
        print(f"{lib}: tokenizer set-up {data['tokenizer_ms']:.0f} ms; mask over all walks "
              f"p50 {data['mask_p50_us']:.1f} us, p99 {data['mask_p99_us']:.1f} us")
        for case, row in data["cases"].items():
            if "error" in row:
                print(f"  {case}: {row['error']}")
    row = results.get("matcher")
    if row:
        print(f"skippy_zmq.text.constrain.Matcher (JSON cases): apply p50 {row['apply_p50_us']:.1f} / p99 "
              f"{row['apply_p99_us']:.1f} us, advance p50 {row['advance_p50_us']:.1f} / p99 "
              f"{row['advance_p99_us']:.1f} us, mask_stats mean {row['mask_mean_us']:.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct")
    parser.add_argument("--out", default="bench-out/constrain.json")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per case (median kept)")
    args = parser.parse_args(argv)
    tokenizer = TextTokenizer.load(args.model_dir)
    results = {"model_dir": args.model_dir, "vocab_size": tokenizer.vocab_size,
               "python": sys.version.split()[0], "machine": platform.machine(),
               "versions": {p: _pkg(p) for p in ("llguidance", "xgrammar", "outlines-core")},
               "libraries": {}}
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            lib = cls(tokenizer)
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
            continue
        results["libraries"][cls.name] = bench_library(lib, tokenizer, args.repeats)
    if "llguidance" in results["libraries"]:
        results["matcher"] = bench_matcher(tokenizer, args.model_dir)
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
