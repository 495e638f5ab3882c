"""Random-weight models of real shapes, written straight into our layout (and, on request, a GGUF).

    skippy-zmq random-model --shape llama-3.1-8b --seed 0 --weights q4 --out DIR [--gguf q4_1|f16] [--layers N]

Speed and memory at scale need models of the real sizes, not their knowledge: a
Llama-3.1-8B-shaped model with random weights runs every matmul an 8B model runs.
No HF checkpoint is made on the way; tensors are generated one at a time (seeded
by the tensor's name, so order does not matter) and written to our checkpoint
and, with `--gguf q4_1`, to DIR/model.gguf as they come, so an 8B model is made in
a few GiB of memory. `--gguf f16` writes the same values as F16 instead: the input of
llama.cpp's `llama-quantize`, which makes the recipes people download (Q4_K_M, Q6_K, IQ4_XS...)
of a real shape from it (bench/recipes.py); `--gguf-only` skips our checkpoint then.

The 2-D weights are generated as GGUF Q4_1 blocks (32 weights: levels 0..15, an
f16 scale d and an f16 offset m), so the checkpoint and the GGUF hold the very
same weights and llama.cpp runs exactly what we run. Every block uses both level
0 and level 15, so its min/max grid is its own: any requantisation (q4 or int8
min/max grids) reproduces it. Statistics: weights ~ N(0, 0.02)-like (std
INIT_STD), norms 1 + small noise, biases small; activations stay O(1) through
the layers.

Tokenizer: a word-level vocabulary `<t0> ... <tV-1>` (whitespace-separated
words -> their ids; decode gives the words back). No chat template, no BOS or
EOS: generation runs to max tokens. With `--vocab FILE.gguf` (e.g. llama.cpp's
ggml-vocab-llama-bpe.gguf) or `--vocab DIR` (a converted model's tokenizer files)
the tokenizer, its special ids and chat template come from that vocabulary
instead, and the model's vocab_size follows it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from skippy_zmq.devtools.gguf_writer import BLOCK, GGUF_ARCH, TENSOR_TYPES, GGUFStream, TensorSpec

if TYPE_CHECKING:   # checkpoint.formats and .convert import JAX: every CLI process builds the parser
    from skippy_zmq.checkpoint.formats import Encoded   # (cli.main: random_cli reads SHAPES), a worker
    # and the driver too, which need no JAX (~1.2 CPU s each); they are imported where used

INIT_STD = 0.02       # std of the 2-D weights (levels uniform in 0..15 have std 4.61)
LEVEL_STD = float(np.sqrt((16 ** 2 - 1) / 12))
WEIGHT_FORMATS = ("f32", "bf16", "int8", "q4")   # checkpoint.FORMATS (not imported: the CLI parser stays light)
GENERATOR_VERSION = 1  # part of the digest: bump when the weights a (shape, seed) gives change

_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def _llama(hidden: int, layers: int, heads: int, ffn: int, tied: bool, factor: float | None,
           theta: float = 500000.0, vocab: int = 128256, max_pos: int = 131072, head_dim: int | None = None,
           eps: float = 1e-5) -> dict[str, Any]:
    cfg = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": 8, "head_dim": head_dim or hidden // heads, "intermediate_size": ffn,
           "vocab_size": vocab, "tie_word_embeddings": tied, "rope_theta": theta, "rms_norm_eps": eps,
           "max_position_embeddings": max_pos, "hidden_act": "silu"}
    if factor is not None:
        cfg["rope_scaling"] = dict(_LLAMA3, factor=factor)
    return cfg


def _qwen(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, tied: bool,
          vocab: int = 151936) -> dict[str, Any]:
    return {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": ffn,
            "vocab_size": vocab, "tie_word_embeddings": tied, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768, "hidden_act": "silu"}


def _gemma3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, window: int, max_pos: int,
            vocab: int, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """google/gemma-3-*: the text model's config (transformers 4 layout, as the Hub files are)."""
    return {"model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 256, "intermediate_size": ffn,
            "vocab_size": vocab, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": scaling, "sliding_window": window, "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": max_pos,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106]}


# microsoft/Phi-4-mini-instruct's longrope factors (48 = rotary dims 96 / 2)
_PHI4_LONG = [1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
              2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
              5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
              11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
              25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
              32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]
_PHI4_MINI = {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 24,
              "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 200064, "tie_word_embeddings": True,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
              "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
              "rope_scaling": {"type": "longrope", "long_factor": _PHI4_LONG, "short_factor": [1.0] * 48},
              "sliding_window": 262144, "bos_token_id": 199999, "eos_token_id": 200020}

# The real models' config.json values (HF layout), less their vocabularies' contents.
SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): the default model's shape; with `--vocab` its GGUF and
    # `--layers 4`, a model the suite's process tests start in seconds
    "smollm2-135m": {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "max_position_embeddings": 8192, "hidden_act": "silu"},
    "llama-3.2-1b": _llama(2048, 16, 32, 8192, tied=True, factor=32.0),
    "llama-3.2-3b": _llama(3072, 28, 24, 8192, tied=True, factor=32.0),
    "llama-3.1-8b": _llama(4096, 32, 32, 14336, tied=False, factor=8.0),
    "qwen2.5-0.5b": _qwen(896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": _qwen(1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, tied=False, vocab=152064),
    # Mistral-7B-v0.3: the llama architecture, 32768 tokens, no rope scaling.
    "mistral-7b": _llama(4096, 32, 32, 14336, tied=False, factor=None, theta=1000000.0, vocab=32768,
                         max_pos=32768) | {"model_type": "mistral"},
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, window=512, max_pos=32768, vocab=262144, scaling=None),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240, window=1024, max_pos=131072, vocab=262208,
                          scaling={"rope_type": "linear", "factor": 8.0}),
    "phi-4-mini": _PHI4_MINI,
    # Mixture of experts (config.json of Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen2-57B-A14B)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                      "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                      "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False},
    "mixtral-8x7b": _llama(4096, 32, 32, 14336, tied=False, factor=None, theta=1000000.0, vocab=32000,
                           max_pos=32768) | {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2-57b-a14b": _qwen(3584, 28, 28, 4, 18944, tied=False) | {
        "model_type": "qwen2_moe", "head_dim": 128, "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}


class RandomModelError(ValueError):
    """A random model cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class RandomSpec:
    """What a random model is: the shape's config (layers possibly cut), the seed and the weight format."""

    shape: str
    seed: int = 0
    weights: str = "q4"
    layers: int | None = None
    vocab: str | None = None   # a GGUF vocabulary file or model dir: the tokenizer (and template), not <tN> words

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise RandomModelError(f"unknown shape {self.shape!r} (known: {', '.join(SHAPES)})")
        full = SHAPES[self.shape]["num_hidden_layers"]
        if self.layers is not None and not 1 <= self.layers <= full:
            raise RandomModelError(f"--layers must be in 1..{full} for {self.shape}, got {self.layers}")

    @property
    def hf_config(self) -> dict[str, Any]:
        cfg = dict(SHAPES[self.shape])
        if self.layers is not None:
            cfg["num_hidden_layers"] = self.layers
        if self.vocab is not None:   # the vocabulary decides the embedding's rows and the special ids
            tok = vocab_tokenizer(self.vocab)
            cfg.update(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_ids)
        return cfg

    @property
    def name(self) -> str:
        return f"random-{self.shape}-L{self.hf_config['num_hidden_layers']}-s{self.seed}-{self.weights}"

    def digest(self) -> str:
        """The model's identity (prefix-cache keys): shape, layers, seed, format and generator version."""
        ident = {"shape": self.shape, "config": self.hf_config, "seed": self.seed, "weights": self.weights,
                 "generator": GENERATOR_VERSION}
        if self.vocab is not None:
            ident["vocab"] = vocab_digest(self.vocab)
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- tensors


def model_config(spec: RandomSpec) -> Any:
    """The ModelConfig of a spec, read from its HF config the way `convert --hf` reads one."""
    from skippy_zmq.checkpoint.families import hf_model_config

    return hf_model_config(spec.hf_config, name=spec.name)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """One generator per (seed, tensor name): a tensor's values do not depend on what was made before it."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_q4_blocks(rng: np.random.Generator, rows: int, cols: int, std: float = INIT_STD) -> Encoded:
    """Uniform levels with 0 and 15 in every block; d jittered around std / 4.61; m centres the block near 0."""
    from skippy_zmq.checkpoint.formats import q4_blocks

    if cols % BLOCK:
        raise RandomModelError(f"a q4 weight needs its input width to be a multiple of {BLOCK}, got {cols}")
    nb = cols // BLOCK
    levels = rng.integers(0, 16, size=(rows, nb, BLOCK), dtype=np.uint8)
    low = rng.integers(0, BLOCK, size=(rows, nb, 1))
    high = (low + rng.integers(1, BLOCK, size=(rows, nb, 1))) % BLOCK     # a different position
    np.put_along_axis(levels, low, np.uint8(0), axis=2)
    np.put_along_axis(levels, high, np.uint8(15), axis=2)
    d = (std / LEVEL_STD) * np.exp(0.1 * rng.standard_normal((rows, nb), dtype=np.float32))
    d16 = d.astype(np.float16)
    m = -7.5 * d16.astype(np.float32) + 0.1 * std * rng.standard_normal((rows, nb), dtype=np.float32)
    return q4_blocks(levels.reshape(rows, cols), d16, m.astype(np.float16))


def random_vector(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """Norm weights 1 + N(0, 0.05); biases N(0, 0.05); float32."""
    noise = 0.05 * rng.standard_normal(n, dtype=np.float32)
    return (1.0 + noise) if kind == "norm" else noise


def tensor_specs(cfg: Any) -> list[TensorSpec]:
    """Every tensor of a ModelConfig in GGUF order: embedding, the layers, final norm, head (untied)."""
    from skippy_zmq.checkpoint.convert import EXPERT_NAMES, LAYER_NAMES, ROUTER_NAME, SHARED_NAMES, TOP_NAMES
    from skippy_zmq.model.weights import ROUTER_KEYS, expert_of, layer_shapes

    specs = [TensorSpec("top", "embed", TOP_NAMES["embed"][0], (cfg.vocab_size, cfg.d_model))]
    for i in range(cfg.n_layers):
        shapes = layer_shapes(cfg, i)   # ours: [in, out] for 2-D
        experts = sorted((expert_of(k)[1], expert_of(k)[0], k) for k in shapes if expert_of(k))
        for key in [k for k in shapes if not expert_of(k)] + [k for _, _, k in experts]:
            shape, which = tuple(reversed(shapes[key])), expert_of(key)
            if which:   # an expert: its slice of llama.cpp's 3-D tensor, all of one matrix's experts in a row
                specs.append(TensorSpec(str(i), key, f"blk.{i}.{EXPERT_NAMES[which[1]]}", shape, which[0], cfg.n_experts))
            elif key in ROUTER_KEYS or key in SHARED_NAMES:
                name = ROUTER_NAME if key == "router" else SHARED_NAMES[key]
                specs.append(TensorSpec(str(i), key, f"blk.{i}.{name}", shape, f32=key in ROUTER_KEYS))
            else:
                specs.append(TensorSpec(str(i), key, f"blk.{i}.{LAYER_NAMES[key][0]}", shape))
    specs.append(TensorSpec("top", "norm", TOP_NAMES["norm"][0], (cfg.d_model,)))
    if not cfg.tied_embeddings:
        specs.append(TensorSpec("top", "head", TOP_NAMES["head"][0], (cfg.vocab_size, cfg.d_model)))
    return specs


def make_tensor(spec: TensorSpec, seed: int) -> Encoded | np.ndarray:
    rng = tensor_rng(seed, spec.gguf_name if spec.part < 0 else f"{spec.gguf_name}/{spec.part}")
    if spec.is_matrix:
        return random_q4_blocks(rng, *spec.shape)
    return random_vector(rng, spec.shape[0], "norm" if spec.key.endswith("norm") else "bias")


def random_tensors(cfg: Any, seed: int) -> Iterator[tuple[TensorSpec, Encoded | np.ndarray]]:
    """(spec, tensor) one at a time, in HF row order (GGUF's Q/K permutation is the GGUF writer's business)."""
    for spec in tensor_specs(cfg):
        yield spec, make_tensor(spec, seed)


# ---------------------------------------------------------------- tokenizer


def word_tokenizer(vocab_size: int) -> Any:
    """TextTokenizer over `<t0> ... <tV-1>` (tokenizer.word_level_tokenizer)."""
    from skippy_zmq.text.tokenizer import TextTokenizer, word_level_tokenizer

    return TextTokenizer(*word_level_tokenizer(vocab_size))


@functools.lru_cache(maxsize=4)
def vocab_tokenizer(path: str) -> Any:
    """TextTokenizer of a GGUF vocabulary file or of a converted model's directory (its tokenizer.json
    and tokenizer_meta.json), read once per path, or RandomModelError naming why not."""
    from skippy_zmq.text.tokenizer import TextTokenizer

    if not Path(path).exists():
        raise RandomModelError(f"--vocab {path}: no such file")
    try:
        return TextTokenizer.load(path) if Path(path).is_dir() else TextTokenizer.from_gguf(path)
    except Exception as exc:  # the GGUF reader and tokenizers raise assorted errors on bad files
        raise RandomModelError(f"--vocab {path}: cannot build its tokenizer: {exc}") from exc


@functools.lru_cache(maxsize=4)
def vocab_digest(path: str) -> str:
    from skippy_zmq.files.fetch import sha256_file

    from skippy_zmq.text.tokenizer import TOKENIZER_FILE

    return sha256_file(Path(path) / TOKENIZER_FILE if Path(path).is_dir() else Path(path))


# ---------------------------------------------------------------- writing


def write_random_model(spec: RandomSpec, out: Path, gguf: str | None = None, checkpoint: bool = True) -> Any:
    """Write OUT/{model.json, params/, tokenizer files, source.json} and, with gguf="q4_1" or "f16",
    OUT/model.gguf (checkpoint=False: the GGUF alone).

    Tensors are made one at a time and go to both files before the next is made.
    """
    from skippy_zmq.checkpoint.checkpoint import CheckpointWriter

    if gguf not in (None, *TENSOR_TYPES):
        raise RandomModelError(f"--gguf must be one of {', '.join(TENSOR_TYPES)}, got {gguf!r}")
    if not (gguf or checkpoint):
        raise RandomModelError("--gguf-only needs --gguf (there would be nothing to write)")
    if gguf and spec.vocab:   # GGUFStream writes no_vocab metadata (prompts as ids)
        raise RandomModelError("--gguf with --vocab is not implemented (the GGUF would carry no vocabulary)")
    out = Path(out)
    cfg = model_config(spec)
    if gguf and (cfg.arch not in GGUF_ARCH or cfg.dense_layers):   # Gemma 3 / Phi-3 (norm shift, fused
        # tensors) are not written; llama.cpp's MoE architectures route every layer
        raise RandomModelError(f"--gguf is not implemented for {spec.shape} (arch {cfg.arch}"
                               f"{', dense layers between MoE layers' if cfg.n_experts else ''}; only "
                               f"{', '.join(sorted(GGUF_ARCH))}, every layer routed)")
    specs = tensor_specs(cfg)
    out.mkdir(parents=True, exist_ok=True)
    writer = CheckpointWriter(out, cfg, spec.weights) if checkpoint else None
    stream = GGUFStream(out / "model.gguf", cfg, specs, spec.name, gguf) if gguf else None
    _write_tensors(cfg, spec.seed, specs, writer, stream)
    if stream is not None:
        stream.close()
    if writer is None:
        return cfg
    (vocab_tokenizer(spec.vocab) if spec.vocab else word_tokenizer(cfg.vocab_size)).save(out)
    source = {"format": "random", "shape": spec.shape, "layers": cfg.n_layers, "seed": spec.seed,
              "weights": spec.weights, "generator": GENERATOR_VERSION, "sha256": spec.digest()}
    if gguf:
        source["file"] = "model.gguf"
    writer.finish(source)
    return cfg


def _write_tensors(cfg: Any, seed: int, specs: list[TensorSpec], writer: Any, stream: GGUFStream | None) -> None:
    """Each tensor, made one at a time, to the checkpoint writer and the GGUF stream (either may be None)."""
    per_layer: dict[str, int] = {}
    for s in specs:
        per_layer[s.where] = per_layer.get(s.where, 0) + 1
    done: dict[str, int] = {}
    for ts, tensor in random_tensors(cfg, seed):
        if stream is not None:
            stream.write(ts, tensor)
        if writer is None:
            pass
        elif ts.where == "top":
            writer.add_top(ts.key, tensor)   # norm; embed / head are split into row blocks by the writer
        else:
            writer.put_layer_tensor(int(ts.where), ts.key, tensor)
            done[ts.where] = done.get(ts.where, 0) + 1
            if done[ts.where] == per_layer[ts.where]:     # a layer's tensors come together (tensor_specs)
                writer.end_layer(int(ts.where))
        del tensor                          # before the next is made: one big tensor in memory at a time
