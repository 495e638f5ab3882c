"""`convert --gguf` keeps every common GGUF type as it is: a tiny llama GGUF with one matrix of each of
the 15 kept types (K and IQ4 blocks random with sane scales, the rest quantised by gguf-py) converts
into a checkpoint of the file's own blocks (Q/K rows unpermuted whole), about the file's size; a stage
runs it in those types and picks the same greedy ids as a float32 run on the dequantised weights, in
one process and in two stages; a type we do not keep is refused by name before any weight is written;
`--weights` requantises and says which tensors; plan and placement count what is stored."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from skippy_zmq.checkpoint import checkpoint, loader, runtime
from skippy_zmq.checkpoint.convert import LAYER_NAMES, ConvertError, convert_gguf, unpermute_rows
from skippy_zmq.config.model import Buckets, KVConfig, ModelConfig
from skippy_zmq.files.gguf_layout import read_gguf_layout
from skippy_zmq.model import ggml, quant
from skippy_zmq.model.runner import SliceRunner
from skippy_zmq.ops import placement, planner
from test_families_gguf import write_metadata
from test_quant_ggml import F16_FIELDS
from model_helpers import restore_stage

# every in-width a multiple of 256, so K blocks fit
CFG = ModelConfig(arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                  vocab_size=320, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=False, max_seq_len=512,
                  eos_ids=(2,), bos_id=1, name="kept")
TYPES = {0: {"wq": "Q4_K", "wk": "Q5_K", "wv": "Q6_K", "wo": "Q2_K", "w_gate": "Q3_K", "w_up": "IQ4_XS",
             "w_down": "IQ4_NL"},
         1: {"wq": "Q4_0", "wk": "Q4_1", "wv": "Q5_0", "wo": "Q5_1", "w_gate": "Q8_0", "w_up": "F16", "w_down": "BF16"}}
KV = KVConfig(lanes=1, capacity=128)
BUCKETS = Buckets(prefill_chunks=(16,), decode_rows=(1,), attn_lens=(128,))


def blocks_of(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """[out, row bytes] of `kind`: gguf-py's quantisation of small random weights where it has one,
    else random block bytes whose f16 scales are small normal numbers (finite, modest values)."""
    w = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "F32":
        return w.view(np.uint8)
    try:
        return np.asarray(gguf.quants.quantize(w, Q[kind])).view(np.uint8).reshape(shape[0], -1)
    except NotImplementedError:
        pass
    t = ggml.TYPES[kind]
    raw = rng.integers(0, 256, (shape[0], shape[1] // t.block, t.nbytes), dtype=np.uint8)
    for f in F16_FIELDS[kind]:
        scale = rng.uniform(2.0 ** -15, 2.0 ** -13, raw.shape[:2]).astype(np.float16)
        raw[..., f:f + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def write_kept_gguf(path: Path, types: dict, top: dict[str, str], extra: dict[str, str] | None = None,
                    seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
    """The tiny model as a GGUF of `types` per layer key and `top` ("embed", "head"); `extra`:
    more tensors by name -> type (random bytes). Returns name -> (type, raw blocks) as written."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    write_metadata(w, CFG, CFG.head_dim)
    written = {}

    def add(name: str, kind: str, shape: tuple[int, ...]) -> None:
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        raw = blocks_of(kind, shape, rng) if kind in ggml.TYPES else \
            rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(shape, Q[kind]), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=Q[kind])
        written[name] = (kind, raw)

    d, v = CFG.d_model, CFG.vocab_size
    add("token_embd.weight", top["embed"], (v, d))
    add("output_norm.weight", "F32", (d,))
    if "head" in top:
        add("output.weight", top["head"], (v, d))
    for i in range(CFG.n_layers):
        for key, shape in (("attn_norm", (d,)), ("ffn_norm", (d,)), ("wq", (256, d)), ("wk", (128, d)),
                           ("wv", (128, d)), ("wo", (d, 256)), ("w_gate", (512, d)), ("w_up", (512, d)),
                           ("w_down", (d, 512))):
            add(f"blk.{i}.{LAYER_NAMES[key][0]}", types[i].get(key, "F32"), shape)
    for name, kind in (extra or {}).items():
        add(name, kind, (32, 256))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the gguf checkpoint, an f32 one of the same file, what the file holds)."""
    tmp = tmp_path_factory.mktemp("kept")
    written = write_kept_gguf(tmp / "m.gguf", TYPES, {"embed": "Q6_K", "head": "F32"})
    convert_gguf(tmp / "m.gguf", tmp / "gguf")
    convert_gguf(tmp / "m.gguf", tmp / "f32", "f32")
    return tmp / "gguf", tmp / "f32", written


def runners(model: Path, fmt: str, cuts: tuple[int, ...] = (), n_layers: int = CFG.n_layers) -> list[SliceRunner]:
    bounds = [0, *cuts, n_layers]
    out = []
    for start, end in zip(bounds, bounds[1:]):
        cfg, params = loader.load_slice(model, start, end, fmt=fmt)
        out.append(SliceRunner(cfg, params, start, end, KV, BUCKETS))
    return out


def dequantised(model: Path, n_layers: int = CFG.n_layers) -> list[SliceRunner]:
    """One runner of f32 on a gguf checkpoint's dequantised weights, made in memory from its stored
    blocks by the same ggml.dequantize that `convert --weights f32` writes with (the tiny model's
    test_an_in_memory_f32_reference_is_the_f32_checkpoint: equal arrays): a real model's f32
    checkpoint written and restored cost ~10 s CPU per recipe."""
    cfg = dataclasses.replace(loader.read_model_json(model / "model.json"), dtype="float32")
    params = runtime.to_runtime(checkpoint.stage_items(model, cfg, 0, n_layers), "f32", jnp.float32)
    return [SliceRunner(cfg, params, 0, n_layers, KV, BUCKETS)]


def greedy(rs: list[SliceRunner], ids: np.ndarray, n: int) -> list[int]:
    x = ids[:-1]
    for r in rs:
        x = r.prefill(0, x, 0, output="none" if r.last else "hidden")
    out, token = [], int(ids[-1])
    for pos in range(len(ids) - 1, len(ids) - 1 + n):
        x = np.array([token])
        for r in rs:
            x = r.decode(np.array([0]), x, np.array([pos]))
        token = int(np.argmax(x[0]))
        out.append(token)
    return out


def test_every_kept_type_is_stored_as_the_files_blocks(kept):
    path, _, written = kept
    manifest = json.loads((path / "params" / "format.json").read_text())
    assert manifest["weights"] == "gguf"
    assert manifest["types"]["embed"] == "Q6_K" and manifest["types"]["head"] == "F32"
    assert manifest["types"]["layers"] == [TYPES[0], TYPES[1]]
    assert {k for layer in TYPES.values() for k in layer.values()} | {"Q6_K", "F32"} == set(ggml.TYPES)
    tree = restore_stage(path, CFG)
    heads = {"wq": CFG.n_heads, "wk": CFG.n_kv_heads}
    for i, layer in TYPES.items():
        for key, kind in layer.items():
            raw = written[f"blk.{i}.{LAYER_NAMES[key][0]}"][1]
            stored = tree["layers"][str(i)][key]
            want = unpermute_rows(raw, heads[key]) if key in heads else raw
            np.testing.assert_array_equal(stored["blocks"], want)      # the file's bytes, rows unpermuted whole
            np.testing.assert_array_equal(checkpoint.to_float(stored),
                                          unpermute_rows(gguf.quants.dequantize(raw, Q[kind]), heads[key])
                                          if key in heads else gguf.quants.dequantize(raw, Q[kind]))
    np.testing.assert_array_equal(tree["embed"]["blocks"], written["token_embd.weight"][1])
    source = json.loads((path / "source.json").read_text())
    assert source["weights"] == "gguf" and source["requantised"] == {} and source["requantised_tensors"] == []
    assert source["checkpoint_bytes"] / source["gguf_tensor_bytes"] <= 1.05


def test_an_in_memory_f32_reference_is_the_f32_checkpoint(kept):
    """The real recipes' f32 reference (`dequantised`) holds exactly the arrays an f32 conversion of
    the same file restores, every kept type's blocks among them."""
    path, f32, _ = kept
    ours, want = dequantised(path)[0].params, runners(f32, "f32")[0].params
    assert jax.tree.structure(ours) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("where", ["step", "load"])
def test_a_gguf_stage_computes_on_the_files_values(kept, where, monkeypatch):
    """Greedy ids of the gguf checkpoint run as stored = those of f32 on the dequantised weights,
    1 process and 2 stages, whether types without a CPU kernel are dequantised in the step or once
    at load; what a stage holds is counted exactly by placement."""
    monkeypatch.setenv(ggml.DEQUANTISE_ENV, where)
    path, f32, _ = kept
    ids = np.random.default_rng(3).integers(3, CFG.vocab_size, 9)
    want = greedy(runners(f32, "f32"), ids, 12)
    for cuts in ((), (1,)):
        rs = runners(path, "auto", cuts)
        assert greedy(rs, ids, 12) == want, cuts
        for r in rs:
            leaves = {id(a): a for a in jax.tree.leaves(r.params)}.values()
            assert sum(a.nbytes for a in leaves) == checkpoint.stage_nbytes(
                CFG, r.start, r.end, "gguf", "gguf", types=checkpoint.kept_types(path))
    layer = rs[0].params["layers"][0]
    if where == "step":
        assert isinstance(layer["wq"], ggml.BlockTensor) and layer["wq"].kind == "Q4_K"
    else:       # float32 [in, out], the in-step dequantiser's values exactly
        want_wq = ggml.dequantize(np.asarray(restore_stage(path, CFG)["layers"]["0"]["wq"]["blocks"]), "Q4_K")
        np.testing.assert_array_equal(np.asarray(layer["wq"]), want_wq.T)
    second = rs[1].params["layers"][0]   # (q fused with k, or k and v, where they match: model/fuse.py)
    assert type(second.get("wq", second.get("wqk", second.get("wqkv")))).__name__ == "QTensor"   # Q4_0: levels
    assert isinstance(rs[0].params["embed"], ggml.BlockTensor)             # gathered per row either way


def test_dequantising_at_load_gives_the_in_step_ids_and_placement_counts_it(kept, monkeypatch):
    """A CPU stage ("auto") dequantises the types the kernel does not read (F16, BF16) once at load:
    greedy ids equal the in-step path's, and placement (a CPU stage's settings) counts the float32 bytes
    it then holds; a GPU stage's count stays the blocks."""
    path, _, _ = kept
    ids = np.random.default_rng(5).integers(3, CFG.vocab_size, 9)
    monkeypatch.setenv(ggml.DEQUANTISE_ENV, "step")
    step = runners(path, "auto", (1,))
    in_step = checkpoint.kept_types(path)
    want = greedy(step, ids, 12)
    monkeypatch.delenv(ggml.DEQUANTISE_ENV)
    rs = runners(path, "auto", (1,))
    assert greedy(rs, ids, 12) == want
    types = checkpoint.kept_types(path, "cpu")
    assert types.at_load and not checkpoint.kept_types(path, "gpu:0").at_load and not in_step.at_load
    for r, s in zip(rs, step):
        held = sum(a.nbytes for a in {id(a): a for a in jax.tree.leaves(r.params)}.values())
        assert held == checkpoint.stage_nbytes(CFG, r.start, r.end, "gguf", "gguf", types=types)
        need = placement.stage_need(CFG, r.start, r.end, placement.StageSettings(
            "gguf", types=types))
        assert need.weights == held
    # layer 0 is all K / IQ types, read in place: its blocks; layer 1's F16 / BF16: 4 bytes a weight now
    for start, grows in ((0, False), (1, True)):
        blocks = checkpoint.stage_nbytes(CFG, start, start + 1, "gguf", "gguf", types=in_step)
        assert (checkpoint.stage_nbytes(CFG, start, start + 1, "gguf", "gguf", types=types) > blocks) == grows
    monkeypatch.setenv(ggml.DEQUANTISE_ENV, "sometimes")
    with pytest.raises(ValueError, match="SKIPPY_GGUF_DEQUANTISE='sometimes'"):
        checkpoint.kept_types(path)


@pytest.mark.parametrize("embed", ["Q6_K", "Q8_0"])
@pytest.mark.parametrize("where", ["step", "load", "auto"])
def test_a_tied_head_is_the_embeddings_blocks(tmp_path, embed, where, monkeypatch):
    """No output.weight: the head is the embedding's blocks (Q6_K: the same BlockTensor serves the lookup,
    or dequantised at load a float32 head beside the blocks; on a CPU by default, blocks read in place by
    the kernel; Q8_0: the kernel's int8 levels, packed once, whose columns serve the lookup), counted once each."""
    monkeypatch.setenv(ggml.DEQUANTISE_ENV, where)
    write_kept_gguf(tmp_path / "m.gguf", TYPES, {"embed": embed}, seed=2)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "gguf")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "f32", "f32")
    cfg = ModelConfig.load(tmp_path / "gguf" / "model.json")
    assert cfg.tied_embeddings
    ids = np.random.default_rng(4).integers(3, CFG.vocab_size, 7)
    want = greedy(runners(tmp_path / "f32", "f32"), ids, 10)
    for cuts in ((), (1,)):
        rs = runners(tmp_path / "gguf", "auto", cuts)
        assert greedy(rs, ids, 10) == want, cuts
        for r in rs:
            leaves = {id(a): a for a in jax.tree.leaves(r.params)}.values()
            assert sum(a.nbytes for a in leaves) == checkpoint.stage_nbytes(
                cfg, r.start, r.end, "gguf", "gguf", types=checkpoint.kept_types(tmp_path / "gguf"))
    assert (rs[1].params["head"] is rs[0].params["embed"]) is False
    one = runners(tmp_path / "gguf", "auto")[0].params
    in_place = where == "auto" and embed in ggml.kernel_block_types("cpu")
    assert (one["head"] is one["embed"]) == (embed == "Q8_0" or where == "step" or in_place)
    assert isinstance(one["head"], quant.QTensor) == (embed == "Q8_0")


def test_plan_counts_what_the_gguf_checkpoint_stores(kept):
    path, _, _ = kept
    topo, needs = planner.plan(planner.PlanRequest(path, stages=2, context=128, lanes=1, cache_bytes=0))
    assert [s.weights for s in topo.stages] == ["gguf", "gguf"]
    types = checkpoint.kept_types(path)
    assert [n.weights for n in needs] == [checkpoint.stage_nbytes(CFG, n.start, n.end, "gguf", "gguf", types=types)
                                          for n in needs]


def test_a_type_we_do_not_keep_is_refused_by_name_before_any_weight(tmp_path, monkeypatch):
    write_kept_gguf(tmp_path / "m.gguf", TYPES, {"embed": "Q8_0", "head": "Q8_0"},
                    extra={"blk.0.extra_a.weight": "IQ2_XXS", "blk.1.extra_b.weight": "TQ1_0"})
    from skippy_zmq.checkpoint import sources

    def no_read(self, name, *rows):
        raise AssertionError(f"weight {name!r} read before the types were checked")
    with monkeypatch.context() as m:
        m.setattr(sources.GGUFSource, "read", no_read)
        with pytest.raises(ConvertError, match=r"IQ2_XXS \(blk\.0\.extra_a\.weight\); TQ1_0 \(blk\.1\.extra_b\.weight\)"
                                               r".*--weights q4, int8, bf16 or f32 to requantise"):
            convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_weights_q4_requantises_says_which_and_runs_without_being_told_again(tmp_path):
    write_kept_gguf(tmp_path / "m.gguf", TYPES, {"embed": "Q8_0", "head": "Q6_K"}, seed=1)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "q4", "q4")
    source = json.loads((tmp_path / "q4" / "source.json").read_text())
    assert source["weights"] == "q4"
    assert source["kept"] == {"Q4_0": 1, "Q4_1": 1, "Q8_0": 1, "F32": 5}        # embed Q8_0: int8 rows, exact; 5 norms
    assert source["requantised"] == {"Q4_K": 1, "Q5_K": 1, "Q6_K": 2, "Q2_K": 1, "Q3_K": 1, "IQ4_XS": 1,
                                     "IQ4_NL": 1, "Q5_0": 1, "Q5_1": 1, "Q8_0": 1, "F16": 1, "BF16": 1}
    assert "output.weight" in source["requantised_tensors"] and "blk.1.attn_q.weight" not in source["requantised_tensors"]
    assert checkpoint.stored_weights(tmp_path / "q4") == "q4"
    cfg, params = loader.load_slice(tmp_path / "q4", fmt="auto")                # no --weights q4 again
    assert type(params["layers"][0]["wq"]).__name__ == "QTensor"


def test_an_moe_gguf_keeps_its_expert_blocks(tmp_path, monkeypatch):
    """random-model's Qwen3-MoE GGUF (3-D Q4_1 `_exps` tensors, an f32 router) converts by default into
    its own blocks, expert by expert, and runs with the greedy ids of f32 on the dequantised weights."""
    from skippy_zmq.devtools import random_model
    from test_moe import TINY_MOE

    monkeypatch.setitem(random_model.SHAPES, "tiny", {**random_model.SHAPES["qwen3-30b-a3b"], **TINY_MOE,
                                                      "moe_intermediate_size": 32, "num_experts": 6,
                                                      "num_experts_per_tok": 2})
    random_model.write_random_model(random_model.RandomSpec("tiny", weights="q4"), tmp_path / "m", gguf="q4_1")
    convert_gguf(tmp_path / "m" / "model.gguf", tmp_path / "gguf")
    convert_gguf(tmp_path / "m" / "model.gguf", tmp_path / "f32", "f32")
    types = checkpoint.kept_types(tmp_path / "gguf")
    assert dict(types.layers[0])["x005.w_down"] == "Q4_1" and "router" not in dict(types.layers[0])
    cfg = ModelConfig.load(tmp_path / "gguf" / "model.json")
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 8)
    want = greedy(runners(tmp_path / "f32", "f32"), ids, 10)
    assert greedy(runners(tmp_path / "gguf", "auto", (1,)), ids, 10) == want


# ---------------------------------------------------------------- real recipes (llama.cpp's llama-quantize)


def recipe_file(recipe: str) -> Path:
    """SmolLM2's GGUF requantised into `recipe` by llama-quantize, made once beside the llama.cpp build
    that made it (its cache folder, named by llama.cpp's version) and reused: the same input on every
    run (IQ4_XS took llama-quantize 20 s of CPU); what is under test, the conversion and the stages,
    runs afresh."""
    import os
    import subprocess

    from conftest import REPO
    from skippy_zmq.devtools.bench.llama_build import cache_dir

    quantize = cache_dir() / "build" / "bin" / "llama-quantize"
    source = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not quantize.is_file() or not source.is_file():
        pytest.skip(f"needs {quantize} (`skippy-zmq bench peers --build`) and {source}")
    made = cache_dir() / "recipes" / f"{source.stem}-{recipe}.gguf"
    if not made.is_file():
        made.parent.mkdir(exist_ok=True)
        part = made.with_name(f"{made.name}.{os.getpid()}.part")    # only a finished file has the name
        subprocess.run([str(quantize), "--allow-requantize", str(source), str(part), recipe], check=True,
                       capture_output=True, timeout=600)
        part.rename(made)
    return made


NEW_IDS = 8


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q6_K", "IQ4_XS", "Q3_K_M"])
def test_real_recipes_of_smollm2_keep_their_types_and_greedy_ids(recipe, tmp_path):
    """SmolLM2's GGUF requantised by llama.cpp's own llama-quantize (built by `bench peers --build`) into
    a real mixed recipe: the default convert keeps every tensor's type at about the file's size, and the
    gguf stage's greedy ids (the CPU kernel reading every block type of the file in place: Q4_K / Q5_K /
    Q6_K / Q5_0 / Q5_1 / IQ4_NL / IQ4_XS) equal f32's on the dequantised weights, 1 process and 2 stages;
    the stages hold about the file's bytes (nothing dequantised at load)."""
    made = recipe_file(recipe)
    convert_gguf(made, tmp_path / "gguf")
    held = read_gguf_layout(made).tensors    # the header only (gguf-py's reader parses the vocabulary: ~2 s)
    manifest = json.loads((tmp_path / "gguf" / "params" / "format.json").read_text())
    stored = {manifest["types"]["embed"], *(k for layer in manifest["types"]["layers"] for k in layer.values())}
    assert stored == {Q(t.ggml_type).name for t in held if len(t.dims) == 2}
    source_json = json.loads((tmp_path / "gguf" / "source.json").read_text())
    assert source_json["bytes_ratio"] <= 1.05 and source_json["requantised"] == {}
    cfg = ModelConfig.load(tmp_path / "gguf" / "model.json")
    ref = dequantised(tmp_path / "gguf", cfg.n_layers)    # = an f32 conversion's (test above), in memory
    prompts = [np.random.default_rng(seed).integers(10, cfg.vocab_size, 10) for seed in range(2)]
    # 8 new ids a prompt: every decode step reads every block of the file, so more steps add attention
    # length, not kernel coverage (16 were ~1/3 of this test's CPU: 128 decode steps over 3 runners)
    want = [greedy(ref, ids, NEW_IDS) for ids in prompts]      # the f32 ids, once per prompt for both cuts
    for cuts in ((), (cfg.n_layers // 2,)):
        ours = runners(tmp_path / "gguf", "auto", cuts, cfg.n_layers)     # every layer of the real model
        in_place = {w.kind for r in ours for layer in r.params["layers"] for w in layer.values()
                    if isinstance(w, ggml.BlockTensor) and w.impl == "kernel"}
        assert in_place == stored & set(ggml.kernel_block_types("cpu")) - set(ggml.KERNEL_TYPES) - set(ggml.PANEL_TYPES)
        assert [r.kernels()["matrices"] for r in ours] == ["kernel"] * len(ours)   # every product in the kernel
        nbytes = sum(a.nbytes for a in {id(a): a for r in ours for a in jax.tree.leaves(r.params)}.values())
        assert cuts or nbytes / source_json["gguf_tensor_bytes"] <= 1.05, (nbytes, source_json["gguf_tensor_bytes"])
        for seed, ids in enumerate(prompts):
            assert greedy(ours, ids, NEW_IDS) == want[seed], (recipe, cuts, seed)
