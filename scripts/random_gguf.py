"""Write a random Llama-shaped GGUF, tensor by tensor (little memory), for conversion measurements.

    .venv/bin/python scripts/random_gguf.py models/scale-src/llama-1b.gguf \\
        --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192 [--untied]

Layer matrices are Q4_1 blocks, the embedding Q8_0, an untied head F16 (a type
conversion dequantises and requantises); random levels, so the values mean
nothing. Tokenizer and vocabulary (49152) are the shipped SmolLM2 GGUF's, so
`convert --gguf` reads it like a real file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FROM = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
Q = gguf.GGMLQuantizationType


def copy_tokenizer(w: gguf.GGUFWriter, reader: gguf.GGUFReader) -> int:
    f = {k: v.contents() for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(f["tokenizer.chat_template"])
    return len(f["tokenizer.ggml.tokens"])


def blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random raw blocks [rows, bytes]: Q4_1 (d, m, 16 nibble bytes), Q8_0 (d, 32 int8) or F16 values."""
    if qtype == Q.F16:
        return (0.02 * rng.standard_normal((rows, cols), np.float32)).astype(np.float16)
    nb = cols // 32
    body = rng.integers(0, 256, (rows, nb, 16 if qtype == Q.Q4_1 else 32), np.uint8)
    head = [np.full((rows, nb, 1), 0.002, np.float16).view(np.uint8)]
    if qtype == Q.Q4_1:
        head.append(np.full((rows, nb, 1), -0.015, np.float16).view(np.uint8))
    return np.concatenate(head + [body], axis=-1).reshape(rows, -1)


def tensors(a: argparse.Namespace, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int], Q]]:
    d, hd = a.hidden, a.hidden // a.heads
    out = [("token_embd.weight", (vocab, d), Q.Q8_0), ("output_norm.weight", (d,), Q.F32)]
    if a.untied:
        out.append(("output.weight", (vocab, d), Q.F16))
    for i in range(a.layers):
        out += [(f"blk.{i}.attn_norm.weight", (d,), Q.F32), (f"blk.{i}.ffn_norm.weight", (d,), Q.F32)]
        out += [(f"blk.{i}.{k}.weight", s, Q.Q4_1) for k, s in [
            ("attn_q", (a.heads * hd, d)), ("attn_k", (a.kv_heads * hd, d)), ("attn_v", (a.kv_heads * hd, d)),
            ("attn_output", (d, a.heads * hd)), ("ffn_gate", (a.ffn, d)), ("ffn_up", (a.ffn, d)),
            ("ffn_down", (d, a.ffn))]]
    return out


def write(path: Path, a: argparse.Namespace) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    vocab = copy_tokenizer(w, gguf.GGUFReader(TOKENIZER_FROM))
    for key, value in [("block_count", a.layers), ("context_length", 8192), ("embedding_length", a.hidden),
                       ("feed_forward_length", a.ffn), ("attention.head_count", a.heads),
                       ("attention.head_count_kv", a.kv_heads), ("vocab_size", vocab)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    specs = tensors(a, vocab)
    for name, shape, qtype in specs:
        if qtype == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            size, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            row = shape[1] // size * type_bytes
            w.add_tensor_info(name, (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    for name, shape, qtype in specs:
        if qtype == Q.F32:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        data = blocks(rng, shape[0], shape[1], qtype)   # one tensor in memory at a time
        w.write_tensor_data(data.view(np.uint8) if qtype == Q.F16 else data)
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    for name, default in [("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("ffn", 8192),
                          ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--untied", action="store_true")
    a = p.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write(a.out, a)


if __name__ == "__main__":
    main()
