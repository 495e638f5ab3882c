"""Greedy tokens on a GPU against the CPU, one process each, float32 and bfloat16, per model: the
fastest device check (no stage processes; scripts/gpu-check.sh runs it first).

    python scripts/gpu_tokens.py MODEL_DIR [MODEL_DIR ...] [--device gpu:0] [--tokens 24]

Prints one line per model and dtype: leading tokens equal to one CPU float32 process, and decode tok/s.
Exits 1 when float32 parts from the CPU.
"""

from __future__ import annotations

import argparse

from skippy_zmq.devtools.bench.greedy import first_mismatch
from skippy_zmq.engine.generate import LocalEngine

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default="gpu:0")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    ok = True
    for model in args.models:
        cpu = LocalEngine(model)
        prompt = cpu.tokenizer.encode_chat(PROMPT)
        want = cpu.generate(prompt, max_tokens=args.tokens, ignore_eos=True).token_ids
        for dtype in ("float32", "bfloat16"):
            engine = LocalEngine(model, dtype=dtype, device=args.device)
            engine.generate(prompt, max_tokens=4, ignore_eos=True)   # compile outside the timing
            got = engine.generate(prompt, max_tokens=args.tokens, ignore_eos=True)
            agree = first_mismatch(got.token_ids, want)
            ok &= dtype != "float32" or agree == len(want)
            print(f"{model} {args.device} {dtype}: {agree}/{len(want)} tokens equal to cpu float32, "
                  f"decode {got.decode_tokens_per_s:.1f} tok/s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
