"""Constrained decoding cost on the real pipeline: 1 stream of SmolLM2, decode tokens/s with a
JSON schema (response_format json_schema) divided by tokens/s without one; plus a validity sweep
(every constrained answer must parse and validate against its schema).

Starts the stages of a local topology (write_topology: `--stages` stages on this machine,
speculation as the shipped topologies have it unless `--speculative off`), serves the OpenAI API
in-process and talks to it with the official `openai` client, streamed. Decode rate = (completion
tokens - 1) / (last token time - first token time), so prefill and TTFT are left out. The free
text run uses ignore_eos and max_tokens equal to the mean constrained length, so both decode
about the same number of tokens. Prints a table and writes bench-out/json.json.

    .venv/bin/python scripts/bench_json.py [--runs 5] [--sweep-seeds 10] [--stages 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from skippy_zmq.api.main import build_app  # noqa: E402
from skippy_zmq.api.server import start_in_thread  # noqa: E402
from skippy_zmq.devtools.harness import running_pipeline, write_topology  # noqa: E402

# The cost schema: a list of records, long enough (~150 tokens) that the decode rate is steady.
RECORDS = {"type": "object", "properties": {"people": {
    "type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "city": {"type": "string", "maxLength": 16}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
PROMPT = "List six people with their name, age and city."

# The validity sweep: five schemas with nested objects, enums and arrays.
SWEEP = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                              "active": {"type": "boolean"}},
             "required": ["name", "age", "active"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", "L", "XL"]},
                                              "level": {"enum": [1, 2, 3]}},
             "required": ["color", "size", "level"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tags": {"type": "array", "maxItems": 3,
                                                  "items": {"type": "string", "maxLength": 12}}},
        "required": ["id", "tags"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                  "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                                  "genres": {"type": "array", "maxItems": 3,
                                                             "items": {"enum": ["drama", "comedy", "horror"]}}},
                 "required": ["title"], "additionalProperties": False},
}


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def stream_rate(client: openai.OpenAI, **kwargs) -> tuple[float, int, str]:
    """(decode tokens/s, completion tokens, text) of one streamed chat completion."""
    first = last = None
    text, tokens = "", 0
    for chunk in client.chat.completions.create(model="m", stream=True, stream_options={"include_usage": True},
                                                **kwargs):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            text += chunk.choices[0].delta.content
    rate = (tokens - 1) / (last - first) if first and last and last > first else float("nan")
    return rate, tokens, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sweep-seeds", type=int, default=10, help="seeds per sweep schema (0: no sweep)")
    parser.add_argument("--speculative", choices=("ngram", "off"), default="ngram")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "json.json"))
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-json-"))
    path = write_topology(tmp, args.model_dir, args.stages, kv_lanes=2, driver__max_sessions=2,
                          driver__speculative={"method": args.speculative})
    result: dict = {"stages": args.stages, "speculative": args.speculative, "runs": args.runs}
    with running_pipeline(path, tmp / "run", warm=True) as (engine, tokenizer, topology, _):
        handle = start_in_thread(build_app(topology, engine, tokenizer))
        try:
            client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=600)
            messages = [{"role": "user", "content": PROMPT}]
            base = dict(messages=messages, temperature=0, max_tokens=400)
            stream_rate(client, messages=messages, temperature=0, max_tokens=8)   # warm up both paths
            stream_rate(client, **base, response_format=fmt(RECORDS))
            rows = {"json_schema": [], "free": []}
            lengths = []
            for _ in range(args.runs):
                rate, n, text = stream_rate(client, **base, response_format=fmt(RECORDS))
                jsonschema.validate(json.loads(text), RECORDS)
                rows["json_schema"].append(rate)
                lengths.append(n)
            free_tokens = round(statistics.mean(lengths))
            for _ in range(args.runs):
                rate, n, _ = stream_rate(client, messages=messages, temperature=0, max_tokens=free_tokens,
                                         extra_body={"ignore_eos": True})
                rows["free"].append(rate)
            with_schema, without = statistics.median(rows["json_schema"]), statistics.median(rows["free"])
            result.update(tokens=free_tokens, json_schema_tok_s=round(with_schema, 2), free_tok_s=round(without, 2),
                          ratio=round(with_schema / without, 3), samples=rows)
            sweep = {"valid": 0, "total": 0, "failures": []}
            for name, schema in SWEEP.items():
                for seed in range(args.sweep_seeds):
                    out = client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"Give me a {name} record as JSON."}],
                        response_format=fmt(schema), temperature=1.0, seed=seed, max_tokens=300)
                    sweep["total"] += 1
                    try:
                        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
                        sweep["valid"] += 1
                    except (ValueError, jsonschema.ValidationError) as err:
                        sweep["failures"].append({"schema": name, "seed": seed,
                                                  "finish_reason": out.choices[0].finish_reason,
                                                  "error": str(err)[:200]})
            result["sweep"] = sweep
        finally:
            handle.stop()
    print(f"\n| 1 stream SmolLM2, {args.stages} stages, speculation {args.speculative} | tok/s |")
    print("|---|---|")
    print(f"| free text ({result['tokens']} tokens, ignore_eos) | {result['free_tok_s']} |")
    print(f"| json_schema ({result['tokens']} tokens mean) | {result['json_schema_tok_s']} |")
    print(f"| ratio (json_schema / free) | {result['ratio']} |")
    if args.sweep_seeds:
        s = result["sweep"]
        print(f"| validity sweep: {len(SWEEP)} schemas x {args.sweep_seeds} seeds, temperature 1 | "
              f"{s['valid']}/{s['total']} valid |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
