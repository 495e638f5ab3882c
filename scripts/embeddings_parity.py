"""Cosine between our /v1/embeddings and transformers' pooled final hidden state, on the same GGUF.

Issue 42's goal for embeddings: cosine >= 0.9999 against transformers. Run it from an environment
with the `parity` extra (torch, transformers) against a running server of ours on the same model:

    .venv/bin/skippy-zmq up topologies/smollm2-2stage.yaml &                 # our server
    PY=/path/to/parity-venv/bin/python      # torch, transformers (setup.cfg parity extra), accelerate, gguf, httpx
    $PY scripts/embeddings_parity.py --url http://127.0.0.1:8000 --out bench-out/embeddings_parity.json

Both sides see the same token ids (transformers' tokenizer of the GGUF makes them; our server gets
them as ids) and pool the final-norm hidden states (transformers' `last_hidden_state`): mean over the
tokens and the last token, L2-normalised as our endpoint does. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import numpy as np

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Pipeline parallelism splits a model by layers across machines.",
         "def add(a, b):\n    return a + b\n",
         "Paris is the capital of France; Berlin is the capital of Germany.",
         "日本語のテキストも埋め込めます。"]


def reference(model_dir: Path, gguf: str, texts: list[str]) -> tuple[list[list[int]], dict[str, list[np.ndarray]]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf, dtype=torch.float32).eval()
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    pooled: dict[str, list[np.ndarray]] = {"mean": [], "last": []}
    with torch.no_grad():
        for row in ids:
            hidden = model.model(input_ids=torch.tensor([row])).last_hidden_state[0].double().numpy()
            pooled["mean"].append(hidden.mean(axis=0))
            pooled["last"].append(hidden[-1])
    return ids, pooled


def ours(url: str, ids: list[list[int]], pooling: str) -> list[np.ndarray]:
    resp = httpx.post(f"{url}/v1/embeddings", json={"model": "x", "input": ids, "pooling": pooling,
                                                     "encoding_format": "float"}, timeout=300)
    resp.raise_for_status()
    return [np.asarray(item["embedding"], dtype=np.float64) for item in resp.json()["data"]]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", default="bench-out/embeddings_parity.json")
    args = parser.parse_args()
    gguf = Path(args.gguf)
    ids, pooled = reference(gguf.parent, gguf.name, TEXTS)
    rows = []
    for pooling in ("mean", "last"):
        for text, row, ref, got in zip(TEXTS, ids, pooled[pooling], ours(args.url, ids, pooling)):
            rows.append({"pooling": pooling, "text": text, "tokens": len(row), "cosine": cosine(ref, got),
                         "ours_norm": float(np.linalg.norm(got))})
    print("| pooling | tokens | cosine with transformers | text |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['pooling']} | {r['tokens']} | {r['cosine']:.7f} | {r['text'][:40]!r} |")
    worst = min(r["cosine"] for r in rows)
    print(f"lowest cosine: {worst:.7f} (goal >= 0.9999)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "lowest_cosine": worst}, indent=1))
    return 0 if worst >= 0.9999 else 1


if __name__ == "__main__":
    raise SystemExit(main())
