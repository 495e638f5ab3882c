"""Real llama.cpp recipes of real shapes: a random model of a shape written as an F16 GGUF
(`random-model --gguf f16 --gguf-only`), quantised by llama.cpp's own `llama-quantize` (built by
`bench peers --build`) into the files people download, converted by `convert --gguf` (which keeps
every tensor's type), then run by us on 1 and 2 stages and by llama-bench on the very same file,
in one run.

    skippy-zmq bench scale --shapes llama-3.2-1b --recipes Q4_K_M,Q6_K
    skippy-zmq bench peers --peer-models llama-3.2-1b:Q4_K_M

Shape name -> F16 GGUF -> llama-quantize RECIPE -> convert -> rows. Files live under
models/random/<shape>-L<layers>-s0-f16/ (gitignored): model.gguf (F16), model-<RECIPE>.gguf and
<RECIPE>/ (our checkpoint of it), reused between runs; an F16 file over KEEP_F16_BYTES is deleted
once a case's recipes are made (an 8B one is 16 GB). A random model's GGUF has no vocabulary
(prompts are ids), so llama.cpp's figures come from llama-bench, which needs none. Cases: the
scale case's shape and depth on 1 and 2 stages (those of its stage counts up to 2), 256 tokens of
context at most and 32 new (`recipe_scale_case`), one stream.

`bench peers --peer-models smollm2:Q4_K_M`: SmolLM2's own GGUF requantised into the recipe (FileRecipe);
its vocabulary comes along, so llama-server serves the very file ours runs, side by side.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippy_zmq.devtools.bench.scale_procs import logged_peak_gib, run_measured

RECIPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "IQ4_XS")   # what model hubs hold most
Q4_1 = "q4_1"      # the existing scale rows: random-model's own Q4_1 GGUF and q4 checkpoint
SEED = 0
GiB = 1 << 30
KEEP_F16_BYTES = 4 * GiB    # F16 sources up to this size stay for the next run (the 1B shape: 2.5 GB)


class RecipeError(RuntimeError):
    """A recipe file could not be made; the message names the step and its log."""


@dataclass(frozen=True)
class RecipeModel:
    """One shape (possibly cut to `layers`) in one llama-quantize recipe, and where its files live."""

    shape: str
    recipe: str
    layers: int | None = None
    root: Path = Path("models/random")

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r} (known: {', '.join(RECIPES)})")

    @property
    def dir(self) -> Path:
        from skippy_zmq.devtools.random_model import SHAPES

        layers = self.layers or SHAPES[self.shape]["num_hidden_layers"]
        return self.root / f"{self.shape}-L{layers}-s{SEED}-f16"

    @property
    def f16(self) -> Path:
        return self.dir / "model.gguf"

    @property
    def gguf(self) -> Path:
        return self.dir / f"model-{self.recipe}.gguf"

    @property
    def ours(self) -> Path:
        return self.dir / self.recipe

    @property
    def label(self) -> str:
        return self.shape + (f" (first {self.layers} layers)" if self.layers else "")


@dataclass(frozen=True)
class FileRecipe:
    """A real model's GGUF (SmolLM2's Q4_1, vocabulary and all) requantised by llama-quantize
    (`--allow-requantize`) into `recipe`, as users' files are made: ensure_recipe makes the file and
    our checkpoint of it under <the GGUF's folder>/recipes/ (gitignored with models/)."""

    source: Path
    recipe: str
    requantize = True     # the source is itself quantised (llama-quantize refuses that unless asked)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r} (known: {', '.join(RECIPES)})")

    @property
    def dir(self) -> Path:
        return self.source.parent / "recipes"

    @property
    def f16(self) -> Path:     # what ensure_recipe quantises (named as RecipeModel's F16 source)
        return self.source

    @property
    def gguf(self) -> Path:
        return self.dir / f"{self.source.stem}-{self.recipe}.gguf"

    @property
    def ours(self) -> Path:
        return self.dir / f"{self.source.stem}-{self.recipe}"

    @property
    def label(self) -> str:
        return self.source.stem


def parse_recipes(text: str) -> tuple[str, ...]:
    """'Q4_K_M,q4_1' -> ('Q4_K_M', 'q4_1'); an unknown name is an error that lists them."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RECIPES and n != Q4_1]
    if unknown or not names:
        raise SystemExit(f"--recipes: unknown {unknown or text!r}; known: {', '.join((Q4_1, *RECIPES))}")
    return names


def file_types(gguf: Path) -> dict[str, int]:
    """Tensor count per GGML type in a GGUF (its header alone: gguf.GGUFReader would parse every
    vocabulary entry too, seconds of CPU per file)."""
    from gguf import GGMLQuantizationType

    from skippy_zmq.files.gguf_layout import read_gguf_layout

    counts: dict[str, int] = {}
    for tensor in read_gguf_layout(gguf).tensors:
        name = GGMLQuantizationType(tensor.ggml_type).name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _step(model: RecipeModel | FileRecipe, step: str, got: dict[str, Any], log: Path, path: Path | None) -> dict[str, Any]:
    if got["rc"] != 0:
        raise RecipeError(f"{step} for {model.label} {model.recipe} failed (exit {got['rc']}); see {log}")
    size = path.stat().st_size if path is not None and path.is_file() else None
    return {"model": model.label, "recipe": model.recipe, "step": step, "gguf_gib": _gib(size),
            "wall_s": got["wall_s"], "peak_rss_gib": _gib(got["peak_rss"]), "logged_peak_gib": logged_peak_gib(log)}


def ensure_f16(model: RecipeModel | FileRecipe) -> list[dict[str, Any]]:
    """The shape's F16 GGUF, made (in a subprocess, measured) unless there; its step row if made."""
    if model.f16.is_file():
        return []
    if isinstance(model, FileRecipe):
        raise RecipeError(f"{model.source}: no such GGUF to make {model.recipe} from")
    model.dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "skippy_zmq.cli", "random-model", "--shape", model.shape, "--seed", str(SEED),
           "--gguf", "f16", "--gguf-only", "--out", str(model.dir)]
    if model.layers:
        cmd += ["--layers", str(model.layers)]
    print(f"[bench] recipes: making {model.f16} (random weights, F16)", flush=True)
    log = model.dir / "random-model.log"
    got = run_measured(cmd, log)
    if got["rc"] != 0:
        model.f16.unlink(missing_ok=True)     # a half-written file must not pass for a made one
    return [_step(model, "random-model --gguf f16", got, log, model.f16)]


def ensure_recipe(model: RecipeModel | FileRecipe, quantize: str) -> list[dict[str, Any]]:
    """The recipe's GGUF (llama-quantize from the F16 file) and our checkpoint of it (convert --gguf,
    the file's types kept), each made unless there; the step rows of what was made."""
    steps: list[dict[str, Any]] = []
    if not model.gguf.is_file():
        steps += ensure_f16(model)
        model.dir.mkdir(parents=True, exist_ok=True)
        log, part = model.dir / f"quantize-{model.recipe}.log", model.gguf.with_suffix(".part")
        again = ["--allow-requantize"] if getattr(model, "requantize", False) else []
        got = run_measured([quantize, *again, str(model.f16), str(part), model.recipe, str(os.cpu_count() or 1)], log)
        if got["rc"] != 0:
            part.unlink(missing_ok=True)
        steps.append(_step(model, f"llama-quantize {model.recipe}", got, log, part))
        part.rename(model.gguf)               # only a finished file has the name
    if not (model.ours / "model.json").is_file():
        shutil.rmtree(model.ours, ignore_errors=True)
        log = model.dir / f"convert-{model.recipe}.log"
        got = run_measured([sys.executable, "-m", "skippy_zmq.cli", "convert", "--gguf", str(model.gguf),
                            "--out", str(model.ours)], log)
        steps.append(_step(model, "convert --gguf (types kept)", got, log, model.gguf))
    for row in steps:
        row["types"] = _types_text(file_types(model.gguf))
    return steps


def recipe_scale_case(case: Any) -> Any:
    """A scale case as the recipes run it: 1 and 2 stages (of its own), one stream, 256 of context
    and 32 new tokens at most (every recipe of a shape runs at the same lengths)."""
    from dataclasses import replace

    return replace(case, stages=tuple(n for n in case.stages if n <= 2) or (2,), streams=1,
                   context=min(case.context, 256), new_tokens=min(case.new_tokens, 32))


def _types_text(types: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in types.items())


# ---------------------------------------------------------------- the rows


def ours_run(model: RecipeModel, case: Any, stages: int, tmp: Path) -> dict[str, Any]:
    """One stream through our stages running the file's own blocks (weights gguf): prefill and decode
    tok/s and the greedy tokens (scale.one_stream), after a warm-up of other prompts."""
    from skippy_zmq.devtools.bench.pipeline import measure
    from skippy_zmq.devtools.bench.scale_procs import model_vocab, one_stream, prompt_ids, staggered_pipeline, topology_for

    tmp.mkdir(parents=True, exist_ok=True)
    path = topology_for(tmp, model.ours, stages, case, weights="gguf")
    vocab = model_vocab(model.ours)
    with staggered_pipeline(path, tmp / f"run-{model.shape}-{model.recipe}-{stages}") as (engine, *_rest):
        measure(engine, [prompt_ids(vocab, case.context, seed=2)], 2, strict=False)
        measure(engine, [prompt_ids(vocab, case.context + case.new_tokens - 2, seed=3)], 2, strict=False)
        return one_stream(engine, prompt_ids(vocab, case.context), case.new_tokens)


def recipe_rows(model: RecipeModel, case: Any, binaries: dict[str, str] | None, tmp: Path,
                repeats: int = 2) -> list[dict[str, Any]]:
    """Ours on each of case.stages and llama-bench (its threads: peers_engines.THREADS) on the same
    file, one after another; ratios ours ÷ llama.cpp; greedy tokens of each stage count against 1 stage's."""
    from skippy_zmq.devtools.bench import greedy
    from skippy_zmq.devtools.bench.peers_engines import THREADS, llama_bench

    base = {"model": model.label, "recipe": model.recipe, "context": case.context, "new_tokens": case.new_tokens}
    rows = []
    for n in case.stages:
        got = ours_run(model, case, n, tmp)
        rows.append({**base, "engine": f"skippy_zmq (gguf), {n} stage{'s' if n > 1 else ''}", "stages": n,
                     "prefill_tok_s": got["prefill_tok_s"], "decode_tok_s": got["decode_tok_s"], "tokens": got["tokens"]})
    for row in rows[1:]:
        row["greedy_vs_1_stage"] = f"{greedy.first_mismatch(row['tokens'], rows[0]['tokens'])}/{len(rows[0]['tokens'])}"
    if binaries:
        theirs = llama_bench(binaries["llama-bench"], model.gguf, case.context, case.new_tokens, repeats)
        for row in rows:
            row["prefill_over_llama_cpp"] = _ratio(row["prefill_tok_s"], theirs["prefill_tok_s"])
            row["decode_over_llama_cpp"] = _ratio(row["decode_tok_s"], theirs["decode_tok_s"])
        rows.append({**base, "engine": f"llama-bench ({THREADS} threads, same file)", "stages": None, **theirs})
    return rows


def recipe_case(case: Any, recipes: tuple[str, ...], binaries: dict[str, str] | None, tmp: Path,
                root: Path = Path("models/random")) -> dict[str, Any]:
    """Every recipe of one scale case: make the files (steps), then the rows of each, one process
    tree at a time. Without llama-quantize (peers not built) the recipes cannot be made: none are."""
    if not binaries:
        return {"case": case.shape, "skipped": "llama-quantize not built (bench peers --build)", "rows": [], "steps": []}
    rows, steps = [], []
    for recipe in recipes:
        model = RecipeModel(case.shape, recipe, case.layers, root)
        steps += ensure_recipe(model, binaries["llama-quantize"])
        rows += recipe_rows(model, case, binaries, tmp)
        print(f"[bench] recipes: {model.label} {recipe} done", flush=True)
    f16 = RecipeModel(case.shape, recipes[0], case.layers, root).f16
    if f16.is_file() and f16.stat().st_size > KEEP_F16_BYTES:
        f16.unlink()     # remade on the next run; the recipes and checkpoints stay
    return {"case": case.shape, "rows": rows, "steps": steps}


def recipe_tables(results: list[dict[str, Any]]) -> list[str]:
    from skippy_zmq.devtools.bench.common import print_table

    rows = [{k: v for k, v in r.items() if k != "tokens"} for res in results for r in res["rows"]]
    steps = [s for res in results for s in res["steps"]]
    return [
        print_table("at scale: llama.cpp recipes (random weights of the real shape, llama-quantize's files; ours "
                    "and llama-bench on the same file)", rows,
                    "ours: `convert --gguf` keeps each tensor's type, stages run weights gguf (types without a "
                    "native CPU kernel are dequantised to f32 at load: checkpoint/runtime.py). prefill = prompt / "
                    "time to first token; decode = 1000 / median inter-token ms, one stream; llama-bench: -p "
                    "context, then -n new_tokens at depth context."),
        print_table("at scale: making the recipe files", steps,
                    "random-model writes the F16 GGUF; llama-quantize makes the recipe from it; convert keeps "
                    "its types. types = tensors per GGML type in the recipe's file."),
    ]


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


def _gib(n: int | None) -> float | None:
    return round(n / GiB, 3) if n else None
