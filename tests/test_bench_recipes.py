"""llama.cpp's recipes of random shapes: random-model's F16 GGUF (the same values as its Q4_1 one),
and (slow, where `bench peers --build` has built llama-quantize) real K-quant and IQ4_XS files made
from it, converted with their types kept and run by us on 1 and 2 stages beside llama-bench."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skippy_zmq.devtools.bench import llama_build
from skippy_zmq.devtools.bench.recipes import (RECIPES, FileRecipe, RecipeError, RecipeModel, ensure_recipe, file_types,
                                               parse_recipes, recipe_case)
from skippy_zmq.devtools.bench.scale import ScaleCase
from skippy_zmq.devtools.random_model import RandomModelError, RandomSpec, write_random_model

SMALL = RandomSpec("smollm2-135m", layers=2)   # ffn_down (1536 inputs) takes K-quants; 576-wide tensors fall back


def _tensors(path):
    from gguf import GGUFReader, quants

    return {t.name: (t.tensor_type.name, np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32))
            for t in GGUFReader(str(path)).tensors}


def test_f16_gguf_holds_the_q4_1_files_values_as_f16(tmp_path):
    write_random_model(SMALL, tmp_path / "q4", gguf="q4_1", checkpoint=False)
    write_random_model(SMALL, tmp_path / "f16", gguf="f16", checkpoint=False)
    assert not (tmp_path / "f16" / "model.json").exists()            # --gguf-only: no checkpoint
    q4, f16 = _tensors(tmp_path / "q4" / "model.gguf"), _tensors(tmp_path / "f16" / "model.gguf")
    assert q4.keys() == f16.keys()
    for name, (kind, values) in f16.items():
        want_kind, want = q4[name]
        assert kind == ("F16" if want_kind == "Q4_1" else "F32"), name
        exact = want if kind == "F32" else want.astype(np.float16).astype(np.float32)
        assert np.array_equal(values, exact), name     # Q/K rows permuted alike


def test_gguf_only_needs_a_gguf_and_recipes_are_named(tmp_path):
    with pytest.raises(RandomModelError, match="--gguf-only needs --gguf"):
        write_random_model(SMALL, tmp_path / "m", checkpoint=False)
    with pytest.raises(RandomModelError, match="--gguf must be one of q4_1, f16"):
        write_random_model(SMALL, tmp_path / "m", gguf="q8_0")
    assert parse_recipes("Q4_K_M, q4_1") == ("Q4_K_M", "q4_1")
    with pytest.raises(SystemExit, match=r"unknown \['Q4_K_S'\]; known: q4_1, Q4_K_M"):
        parse_recipes("Q4_K_M,Q4_K_S")
    with pytest.raises(ValueError, match="unknown recipe 'Q2_K'"):
        RecipeModel("llama-3.2-1b", "Q2_K")
    m = RecipeModel("llama-3.2-1b", "IQ4_XS", layers=2, root=tmp_path)
    assert (m.f16, m.gguf, m.ours) == (tmp_path / "llama-3.2-1b-L2-s0-f16" / "model.gguf",
                                       tmp_path / "llama-3.2-1b-L2-s0-f16" / "model-IQ4_XS.gguf",
                                       tmp_path / "llama-3.2-1b-L2-s0-f16" / "IQ4_XS")


def test_a_file_recipe_is_named_beside_its_source_and_needs_it(tmp_path):
    """`bench peers --peer-models smollm2:Q4_K_M`: SmolLM2's own GGUF requantised, under recipes/ beside it;
    a missing source is an error that names it, before llama-quantize runs."""
    m = FileRecipe(tmp_path / "Smol.Q4_1.gguf", "Q4_K_M")
    assert (m.gguf, m.ours, m.f16) == (tmp_path / "recipes" / "Smol.Q4_1-Q4_K_M.gguf",
                                       tmp_path / "recipes" / "Smol.Q4_1-Q4_K_M", tmp_path / "Smol.Q4_1.gguf")
    with pytest.raises(ValueError, match="unknown recipe 'Q4_K_S'"):
        FileRecipe(tmp_path / "Smol.Q4_1.gguf", "Q4_K_S")
    with pytest.raises(RecipeError, match=r"Smol.Q4_1.gguf: no such GGUF to make Q4_K_M from"):
        ensure_recipe(m, "/nonexistent/llama-quantize")
    assert not m.dir.exists()


# ---------------------------------------------------------------- real llama-quantize

RECORD = llama_build.built()
NEEDS_PEERS = pytest.mark.skipif(RECORD is None, reason="llama-quantize and llama-bench are not built here "
                                                        "(skippy-zmq bench peers --build, about 15 minutes)")
# the K / IQ types each recipe gives the tensors whose inputs are a multiple of 256 (ffn_down here;
# Q3_K_M keeps a 2-layer model's ffn_down at Q4_K: its first layers get more bits)
RECIPE_TYPES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"},
                "Q3_K_M": {"Q4_K"}, "IQ4_XS": {"IQ4_XS"}}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple:
    """Every recipe made once for the module, on a fresh root: (the root, recipe -> its step rows).
    llama-quantize runs once per recipe; the rows test below reuses the Q4_K_M file made here."""
    root = tmp_path_factory.mktemp("recipes")
    return root, {recipe: ensure_recipe(RecipeModel("smollm2-135m", recipe, layers=2, root=root),
                                        RECORD["binaries"]["llama-quantize"]) for recipe in RECIPES}


@pytest.mark.slow
@NEEDS_PEERS
def test_every_recipe_is_made_by_llama_quantize_and_converted_with_its_types_kept(made):
    root, steps_of = made
    for recipe in RECIPES:
        model = RecipeModel("smollm2-135m", recipe, layers=2, root=root)
        assert [s["step"] for s in steps_of[recipe]] == \
            (["random-model --gguf f16"] if recipe == RECIPES[0] else []) + \
            [f"llama-quantize {recipe}", "convert --gguf (types kept)"]
        types = file_types(model.gguf)
        assert RECIPE_TYPES[recipe] <= set(types) and "F16" not in types, (recipe, types)
        source = json.loads((model.ours / "source.json").read_text())
        assert (source["weights"], source["kept"], source["dequantised"], source["requantised"]) == \
            ("gguf", types, {}, {}), recipe
        assert ensure_recipe(model, RECORD["binaries"]["llama-quantize"]) == []    # made once, then reused


@pytest.mark.slow
@NEEDS_PEERS
def test_a_recipe_runs_on_1_and_2_stages_beside_llama_bench_in_one_call(made, tmp_path):
    root, steps_of = made
    case = ScaleCase("smollm2-135m", (1, 2), 32, 8, layers=2, streams=1)
    got = recipe_case(case, ("Q4_K_M",), RECORD["binaries"], tmp_path / "run", root=root)
    # the module made Q4_K_M (its steps, F16 first, are checked above): recipe_case makes nothing again
    assert RECIPES[0] == "Q4_K_M" and [s["step"] for s in steps_of["Q4_K_M"]] == [
        "random-model --gguf f16", "llama-quantize Q4_K_M", "convert --gguf (types kept)"]
    assert got["steps"] == []
    ours, theirs = got["rows"][:2], got["rows"][2]
    assert [r["engine"] for r in got["rows"]] == ["skippy_zmq (gguf), 1 stage", "skippy_zmq (gguf), 2 stages",
                                                  "llama-bench (2 threads, same file)"]
    for row in got["rows"]:
        assert row["recipe"] == "Q4_K_M" and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    for row in ours:
        assert len(row["tokens"]) == 8
        assert row["decode_over_llama_cpp"] == round(row["decode_tok_s"] / theirs["decode_tok_s"], 3)
    assert ours[1]["greedy_vs_1_stage"] == "8/8"     # the same blocks split over two processes: the same ids
