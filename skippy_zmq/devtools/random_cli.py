"""`skippy-zmq random-model`: its flags and its command (devtools/random_model.py does the work)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from loguru import logger


def cmd_random_model(args: argparse.Namespace) -> int:
    import resource

    from skippy_zmq.devtools.random_model import RandomModelError, RandomSpec, write_random_model

    t0 = time.perf_counter()
    try:
        spec = RandomSpec(args.shape, args.seed, args.weights, args.layers, args.vocab)
        cfg = write_random_model(spec, Path(args.out), args.gguf, checkpoint=not args.gguf_only)
    except RandomModelError as exc:
        logger.error("random-model failed: {}", exc)
        return 1
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    logger.info("wrote {} ({} layers, {}{}) into {} in {:.1f} s, peak RSS {:.2f} GiB", spec.name, cfg.n_layers,
                "" if args.gguf_only else f"{args.weights} weights, ", f"model.gguf ({args.gguf})" if args.gguf else "",
                args.out, time.perf_counter() - t0, peak_gib)
    return 0


def add_random_model_parser(sub: Any) -> None:
    from skippy_zmq.devtools.random_model import SHAPES, WEIGHT_FORMATS  # numpy only: the parser stays quick

    p = sub.add_parser("random-model", help="a model of a real shape with random weights (and its GGUF)")
    p.add_argument("--shape", required=True, choices=list(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default="q4", choices=WEIGHT_FORMATS, help="checkpoint format (default q4)")
    p.add_argument("--out", required=True)
    p.add_argument("--gguf", default=None, choices=["q4_1", "f16"], help="also write OUT/model.gguf, the same "
                   "weights (f16: their values, what llama-quantize makes recipes from)")
    p.add_argument("--gguf-only", action="store_true", help="write the GGUF alone, no checkpoint")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (fast tests)")
    p.add_argument("--vocab", default=None, metavar="FILE.gguf|DIR",
                   help="take the tokenizer (and chat template) from this GGUF vocabulary or converted model "
                        "directory; vocab_size follows it")
    p.set_defaults(func=cmd_random_model)
