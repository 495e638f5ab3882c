"""Real llama.cpp recipes whose K types SmolLM2 cannot show (its 576-wide rows are not a multiple of 256,
so llama-quantize falls back to 32-blocks there): a small llama shape with 256-multiple rows, written
as an F16 GGUF by random-model and quantised by llama.cpp's own llama-quantize into Q3_K_M (Q3_K with
Q4_K / Q5_K / Q6_K) and Q2_K (Q2_K with Q3_K / Q4_K ...). The default convert keeps every tensor's
type; a CPU stage reads each type in place (the block kernel; nothing dequantised at load), holds about
the file's bytes, and picks the greedy ids of a float32 run on the dequantised weights, 1 process and
2 stages."""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np
import pytest

from skippy_zmq.checkpoint.convert import convert_gguf
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.devtools import random_model
from skippy_zmq.devtools.bench.recipes import file_types
from skippy_zmq.model import ggml
from test_convert_gguf_types import dequantised, greedy, runners

# every row a multiple of 256 (K blocks fit everywhere), small enough for seconds
SMALL = {**random_model.SHAPES["llama-3.2-1b"], "hidden_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1536,
         "vocab_size": 1024, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory):
    from skippy_zmq.devtools.bench.llama_build import cache_dir

    quantize = cache_dir() / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        pytest.skip(f"needs {quantize} (`skippy-zmq bench peers --build`)")
    out = tmp_path_factory.mktemp("small")
    with pytest.MonkeyPatch.context() as m:
        m.setitem(random_model.SHAPES, "small-k", SMALL)
        random_model.write_random_model(random_model.RandomSpec("small-k"), out, gguf="f16",
                                        checkpoint=False)
    return quantize, out / "model.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("recipe,kinds", [("Q3_K_M", {"Q3_K", "Q4_K"}), ("Q2_K", {"Q2_K", "Q3_K"})])
def test_k_recipes_run_in_place_with_the_dequantised_ids(f16_gguf, recipe, kinds, tmp_path):
    quantize, f16 = f16_gguf
    made = tmp_path / f"small.{recipe}.gguf"
    subprocess.run([str(quantize), str(f16), str(made), recipe], check=True, capture_output=True, timeout=600)
    types = file_types(made)
    assert kinds <= set(types), types
    convert_gguf(made, tmp_path / "gguf")
    source = json.loads((tmp_path / "gguf" / "source.json").read_text())
    assert source["bytes_ratio"] <= 1.05 and source["requantised"] == {}
    cfg = ModelConfig.load(tmp_path / "gguf" / "model.json")
    ref = dequantised(tmp_path / "gguf", cfg.n_layers)    # = an f32 conversion's (test_convert_gguf_types)
    prompts = [np.random.default_rng(seed).integers(10, cfg.vocab_size, 10) for seed in range(2)]
    want = [greedy(ref, ids, 16) for ids in prompts]      # the f32 ids, once per prompt for both cuts
    matrices = set(types) - {"F32"}
    for cuts in ((), (1,)):
        ours = runners(tmp_path / "gguf", "auto", cuts, cfg.n_layers)
        in_place = {w.kind for r in ours for layer in r.params["layers"] for w in layer.values()
                    if isinstance(w, ggml.BlockTensor) and w.impl == "kernel"}
        assert kinds <= in_place and in_place <= matrices, (in_place, types)
        held = sum(a.nbytes for r in ours for a in {id(a): a for a in jax.tree.leaves(r.params)}.values())
        assert held / source["gguf_tensor_bytes"] <= 1.05, (held, source["gguf_tensor_bytes"])
        for seed, ids in enumerate(prompts):
            assert greedy(ours, ids, 16) == want[seed], (recipe, cuts, seed)
