"""The verdict of scripts/gpu-check.sh: one table and OUT/gpu-check.json from
what its steps wrote into OUT.

    python -m skippy_zmq.devtools.bench.gpu_check bench-out/gpu [--elapsed-s N]

Reads parity-{float32,bfloat16}.xml (pytest's JUnit reports of tests/test_parity.py),
single/bench.json, pipeline-{float32,bfloat16}/bench.json and moe-{float32,bfloat16}/bench.json
(a mixture-of-experts model's pipeline). Exits 1 unless every check that ran passed:
the parity tests, the single-process benchmark, and each 2-stage pipeline's greedy
tokens against the CPU fp32 run (identical in float32; in bfloat16 at least
BF16_MIN_AGREE leading tokens per prompt). Parity is "not run" (ok None) where
parity-not-run.txt says why (no real model on an offline machine).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from skippy_zmq.devtools.bench.common import print_table

DTYPES = ("float32", "bfloat16")
BF16_MIN_AGREE = 16   # as tests/test_parity.py asks of bfloat16


def check_row(check: str, dtype: str, ok: bool, **numbers: Any) -> dict[str, Any]:
    return {"check": check, "dtype": dtype, "ok": ok, "prefill_tok_s": numbers.get("prefill_tok_s"),
            "decode_tok_s": numbers.get("decode_tok_s"), "agg_tok_s": numbers.get("agg_tok_s"),
            "greedy_vs_cpu": numbers.get("greedy_vs_cpu"), "note": numbers.get("note", "")}


def parity_row(path: Path, dtype: str) -> dict[str, Any]:
    """Passed / total from a JUnit report; a skipped test (no model, no reference) is not a pass."""
    not_run = path.parent / "parity-not-run.txt"
    if not path.is_file() and not_run.is_file():
        return dict(check_row("parity test", dtype, False, note=f"not run: {not_run.read_text().strip()}"), ok=None)
    if not path.is_file():
        return check_row("parity test", dtype, False, note=f"no report ({path.name})")
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    passed = tests - failures - errors - skipped
    return check_row("parity test", dtype, tests > 0 and passed == tests,
                     note=f"{passed}/{tests} passed" + (f", {skipped} skipped" if skipped else ""))


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def single_row(path: Path) -> dict[str, Any]:
    result = load(path)
    if not result or "single" not in result:
        return check_row("bench single", "float32", False, note=f"no result ({path})")
    single, int8 = result["single"], result.get("single_int8") or {}
    return check_row("bench single", result["machine"]["dtype"], True, prefill_tok_s=single["prefill_tok_s"],
                     decode_tok_s=single["decode_tok_s"],
                     note=f"int8 weights: {int8.get('decode_tok_s')} decode tok/s; TTFT {single['ttft_ms']} ms")


def pipeline_row(path: Path, dtype: str, what: str = "pipeline", random: bool = False) -> dict[str, Any]:
    """2-stage pipeline: 1-stream decode, aggregate at the widest sweep point, tokens vs the CPU.

    random: random weights (offline), whose logits are near-ties everywhere: bfloat16's agreement is
    reported, not checked (ok None); float32 must still be identical."""
    result = load(path)
    pipeline = (result or {}).get("pipeline") or {}
    agreement = (pipeline.get("greedy_vs_cpu") or {}).get("stages") or []
    if not pipeline.get("rows") or not agreement:
        return check_row(f"{what}, 2 stages", dtype, False, note=f"no result ({path})")
    widest = max(pipeline["rows"], key=lambda r: r["streams"])
    g = agreement[0]
    ok = g["identical"] == g["prompts"] if dtype == "float32" else min(g["first_mismatch"]) >= BF16_MIN_AGREE
    row = check_row(f"{what}, {g['stages']} stages", dtype, ok,
                    decode_tok_s=pipeline["one_stream"][0]["decode_tok_s"], agg_tok_s=widest["agg_tok_s"],
                    greedy_vs_cpu=g["agree"],
                    note=f"agg at {widest['streams']} streams; first mismatch per prompt {g['first_mismatch']}")
    if random and dtype != "float32":
        row.update(ok=None, note="random weights (near-ties): tokens reported, not checked; " + row["note"])
    return row


def report(out: Path) -> list[dict[str, Any]]:
    random = (out / "parity-not-run.txt").is_file()   # the SmolLM2 pipeline ran on random weights
    return ([parity_row(out / f"parity-{d}.xml", d) for d in DTYPES] + [single_row(out / "single" / "bench.json")]
            + [pipeline_row(out / f"pipeline-{d}" / "bench.json", d, random=random) for d in DTYPES]
            + [pipeline_row(out / f"moe-{d}" / "bench.json", d, "MoE pipeline", random=True) for d in DTYPES
               if (out / f"moe-{d}").is_dir()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="gpu:0")
    ap.add_argument("--elapsed-s", type=float, default=None)
    args = ap.parse_args(argv)
    rows = report(args.out)
    ok = all(r["ok"] is not False for r in rows) and any(r["ok"] for r in rows)
    not_run = sum(r["ok"] is None for r in rows)
    verdict = ("PASS" if ok else "FAIL") + (f" ({not_run} not run)" if not_run else "")
    print_table(f"GPU check on {args.device}: {verdict}", rows,
                "greedy_vs_cpu = leading greedy tokens equal to one CPU fp32 process, summed over the prompts; "
                "tok/s are decode unless named.")
    summary = {"device": args.device, "ok": ok, "elapsed_s": args.elapsed_s, "rows": rows}
    (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out / 'gpu-check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
