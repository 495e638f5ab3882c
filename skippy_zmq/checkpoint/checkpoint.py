"""A checkpoint stores each layer in its serving format (a GGUF's own blocks, f32,
bf16, int8 or q4 levels + f16 scales), still orbax, written incrementally:
conversion streams tensor by tensor and never holds more than one layer.

Choice: one small orbax PyTree checkpoint per item, not one growing
checkpoint. An orbax PyTree save takes the whole tree at once, so a single
checkpoint written incrementally is not something orbax offers; items are.
A writer holds one layer (or one block of 8192 embedding / head rows) at a
time, and a stage restores only the items it owns: its layers, the embedding
when first, norm and head when last.

    OUT/params/format.json       {"version": 2, "weights": "q4", "rows_per_block": 8192, ...}
    OUT/params/top/              {"norm": f32 [D]}
    OUT/params/embed/000000/     rows [0, 8192) of the embedding [V, D], then 000001/, ...
    OUT/params/head/000000/      rows of an untied head [V, D] ([out, in]), same blocks
    OUT/params/layer_00000/      {"attn_norm": f32 [D], "wq": <matrix>, ...}, one item per layer

A <matrix> is [out, in] in its format (formats.py: gguf the file's blocks as
they are, int8 1.125 B/weight, q4 0.625 B/weight like Q4_1); norms and biases
stay f32. A gguf checkpoint's manifest names every matrix's GGUF type ("types"),
so placement counts a stage's bytes without reading it. Under int8 / q4, GGUF
Q4_0 / Q4_1 / Q8_0 blocks come through as their exact levels. In a q4 checkpoint the embedding and
an untied head are int8, as GGUF Q4 files keep them at 8 bits. The embedding is
stored as rows (groups along the row), so the first stage keeps it quantised
and widens only the rows it looks up (quant.QRows), and a tied head is the
very same stored levels, packed for the matmul kernel on the last stage.

A stage may run its checkpoint's format or a coarser one (gguf -> f32 -> bf16 ->
int8 -> q4; gguf dequantises exactly to f32): coarser is quantised at load, tensor by tensor; a finer one is refused
at start with the command that fixes it. Checkpoints from before this layout
(one f32 PyTree under params/, no format.json) still load, as f32.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import orbax.checkpoint as ocp

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model import quant, weights
from skippy_zmq.files.filecheck import read_json_capped
from skippy_zmq.checkpoint.manifest import MANIFEST_FILE, write_manifest
from skippy_zmq.checkpoint.formats import FORMATS, GROUP, KEEP, Blocks, CheckpointError, Encoded, check_format, dequantize_grid, encode, grid, int8_blocks, kept_nbytes, q4_blocks, runtime_nbytes, stored_format, stored_nbytes, stored_type, to_float
from skippy_zmq.model import ggml

VERSION = 2
PART_BYTES = 256 << 20                       # a streamed layer's encoded bytes per part item
PARTS_KEY = "_parts"                         # in a layer's item: how many part items it has
ROWS_PER_BLOCK = 8192                        # embedding / head rows per stored item
MANIFEST = "format.json"


@dataclasses.dataclass(frozen=True)
class KeptTypes:
    """The GGUF type of every matrix a gguf checkpoint stores (its manifest's "types"); hashable, so
    placement's cached byte counts key on it. layers[i]: (key, type) pairs of layer i. at_load: the
    stage dequantises matrices of types without a CPU kernel to float32 once at load
    (ggml.dequantise_at_load for its device), so each counts 4 bytes a weight; in_place: the types
    the kernel reads as blocks instead (ggml.kernel_block_types), which count their blocks."""

    embed: str
    head: str | None
    layers: tuple[tuple[tuple[str, str], ...], ...]
    at_load: bool = False
    in_place: tuple[str, ...] = ()

    def dequantised(self, kind: str) -> bool:
        """Whether a matrix of `kind` is float32 at runtime (dequantised once at load)."""
        return self.at_load and kind not in self.in_place

    def packed(self, kind: str) -> bool:
        """Whether a matrix of `kind` is repacked into the kernel's panels at load (ggml.PANEL_TYPES)."""
        return kind in ggml.PANEL_TYPES and kind in self.in_place


def stage_nbytes(cfg: ModelConfig, start: int, end: int, fmt: str, stored: str | None = None,
                 dtype: str = "float32", types: KeptTypes | None = None) -> int:
    """Exact weight bytes of a stage [start, end) running `fmt` (see runtime_nbytes), what
    runtime.to_runtime holds: its layers, the embedding when first, norm and head when
    last (a tied float head is the embedding; a tied int8 head is built from it). A stage
    running gguf needs the checkpoint's `types` (kept_types)."""
    if fmt == KEEP:
        return _kept_stage_nbytes(cfg, start, end, dtype, types)
    item = np.dtype(dtype).itemsize
    total = 0
    for layer in weights.param_shapes(cfg, start, end)["layers"].values():
        for key, s in layer.items():
            if key in weights.ROUTER_KEYS:      # an MoE router: f32 in every format
                total += 4 * s[0] * s[1]
            else:
                total += runtime_nbytes(s[::-1], fmt, key, stored, dtype) if len(s) == 2 else item * s[0]
    vd = (cfg.vocab_size, cfg.d_model)
    if start == 0:
        total += runtime_nbytes(vd, fmt, "embed", stored, dtype)
    if end == cfg.n_layers:
        total += item * cfg.d_model
        if not cfg.tied_embeddings or fmt in ("int8", "q4"):
            total += runtime_nbytes(vd, fmt, "head", stored, dtype)
        elif start != 0:
            total += runtime_nbytes(vd, fmt, "embed", stored, dtype)
    return total


def kept_layer_nbytes(cfg: ModelConfig, i: int, types: KeptTypes, dtype: str = "float32") -> int:
    """Runtime bytes of layer i of a gguf checkpoint run as gguf: each matrix's kept_nbytes, vectors
    in `dtype`, routers f32."""
    kinds, total = dict(types.layers[i]), 0
    for key, s in weights.layer_shapes(cfg, i).items():
        if key in weights.ROUTER_KEYS:
            total += 4 * s[0] * s[1]
        else:
            kind = kinds.get(key, "")
            total += (kept_nbytes(s[::-1], kind, key, types.dequantised(kind), types.packed(kind)) if len(s) == 2
                      else np.dtype(dtype).itemsize * s[0])
    return total


def _kept_stage_nbytes(cfg: ModelConfig, start: int, end: int, dtype: str, types: KeptTypes | None) -> int:
    """stage_nbytes of a stage running gguf: each matrix's kept_nbytes, vectors in `dtype`, routers f32."""
    if types is None or len(types.layers) != cfg.n_layers:
        raise CheckpointError("a gguf stage's bytes need its checkpoint's GGUF types (checkpoint.kept_types)")
    item = np.dtype(dtype).itemsize
    total = sum(kept_layer_nbytes(cfg, i, types, dtype) for i in range(start, end))
    vd = (cfg.vocab_size, cfg.d_model)
    packed = (cfg.tied_embeddings and end == cfg.n_layers
              and (types.embed in ggml.KERNEL_TYPES or types.packed(types.embed)))
    if start == 0 and not packed:     # (a tied head packed: its columns serve the lookup, one copy)
        total += kept_nbytes(vd, types.embed, "embed")
    if end == cfg.n_layers:
        total += item * cfg.d_model
        if not cfg.tied_embeddings:
            head = types.head or ""
            total += kept_nbytes(vd, head, "head", types.dequantised(head), types.packed(head))
        elif packed or types.dequantised(types.embed):    # a tied head: the embedding's levels packed
            total += kept_nbytes(vd, types.embed, "head", True, types.packed(types.embed))   # or dequantised
        elif start != 0:                                # else the embedding's own blocks
            total += kept_nbytes(vd, types.embed, "embed")
    return total


# ---------------------------------------------------------------- writer


@dataclasses.dataclass
class _OpenLayer:
    """A layer CheckpointWriter.put_layer_tensor is streaming: its tensors not yet written, every key
    put so far, and the part items already written."""
    index: int
    shapes: dict[str, tuple[int, ...]]
    pending: dict[str, Any] = dataclasses.field(default_factory=dict)
    keys: list[str] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    parts: int = 0


class CheckpointWriter:
    """Writes a converted model item by item; memory holds one row block or layer part at a time.

        w = CheckpointWriter(out_dir, cfg, "q4")
        w.add_top("norm", norm)                      # f32 [D]
        w.add_rows("embed", 0, rows)                 # [rows, D] float or Encoded, blocks in order
        w.add_top("head", head_out_in)               # (untied) a whole [V, D]; add_rows streams it
        w.put_layer_tensor(i, "wq", wq_out_in); ...; w.end_layer(i)   # float [out, in] or Encoded
        w.finish({"format": "gguf", "sha256": ...})  # format.json, source.json, then model.json

    Matrices come [out, in] (PyTorch / GGUF order) as float arrays (any float
    dtype, bf16 included) or as exact grids (`q4_blocks`, `int8_blocks`), and
    are stored in `fmt` (requantised or dequantised when the grid differs).
    Q/K row permutations are the caller's business. The tokenizer files are
    the caller's too (write them into out_dir before finish).
    """

    def __init__(self, out_dir: Path, cfg: ModelConfig, fmt: str = "f32", rows_per_block: int = ROWS_PER_BLOCK):
        self.out, self.cfg, self.fmt, self.rows_per_block = Path(out_dir).absolute(), cfg, check_format(fmt), rows_per_block
        self.params = self.out / "params"
        if self.params.exists():
            shutil.rmtree(self.params)
        self.params.mkdir(parents=True)
        (self.out / "model.json").unlink(missing_ok=True)   # its presence means a finished conversion
        (self.out / MANIFEST_FILE).unlink(missing_ok=True)
        self._ckpt = ocp.PyTreeCheckpointer()
        self._rows = {"embed": 0, "head": 0}
        self._layers: set[int] = set()
        self._types: dict[str, Any] = {"layers": {}}   # gguf: every matrix's GGUF type, for the manifest
        self._top: dict[str, np.ndarray] = {}
        self._open: _OpenLayer | None = None   # the layer put_layer_tensor is streaming

    def add_top(self, key: str, w: np.ndarray | Encoded) -> None:
        """"norm" f32 [D], or a whole "embed" / "head" [V, D] (split into row blocks here)."""
        if key == "norm":
            self._top["norm"] = _vector(w, (self.cfg.d_model,), "norm")
            return
        for r in range(0, w.shape[0], self.rows_per_block):
            part = (_grid_rows(w, r, self.rows_per_block) if isinstance(w, Encoded) else
                    w.rows(r, self.rows_per_block) if isinstance(w, Blocks) else w[r:r + self.rows_per_block])
            self.add_rows(key, r, part)

    def add_rows(self, key: str, start: int, rows: np.ndarray | Encoded) -> None:
        """Rows [start, start + len) of "embed" or "head" ([V, D]); blocks come in order, each
        rows_per_block long but the last."""
        if key not in self._rows or start != self._rows[key]:
            raise CheckpointError(f"rows of {key!r} must come in order from 0 (expected {self._rows.get(key)}, got {start})")
        if tuple(rows.shape[1:]) != (self.cfg.d_model,) or (rows.shape[0] != self.rows_per_block
                                                           and start + rows.shape[0] != self.cfg.vocab_size):
            raise CheckpointError(f"{key} rows at {start}: shape {tuple(rows.shape)}, expected "
                                  f"[{self.rows_per_block} (or the last rows), {self.cfg.d_model}]")
        stored = encode(rows, stored_format(self.fmt, key))
        self._record_type(key, stored)
        self._save(f"{key}/{start // self.rows_per_block:06d}", stored)
        self._rows[key] = start + rows.shape[0]

    def _record_type(self, key: str, stored: dict[str, Any], layer: int | None = None) -> None:
        """A gguf checkpoint's manifest names each matrix's type (one type per matrix)."""
        if "ggml_type" not in stored:
            return
        where = self._types if layer is None else self._types["layers"].setdefault(layer, {})
        if where.setdefault(key, stored_type(stored)) != stored_type(stored):
            raise CheckpointError(f"{key}: rows of two GGUF types ({where[key]}, {stored_type(stored)})")

    def put_layer_tensor(self, i: int, key: str, w: np.ndarray | Encoded) -> None:
        """Stream one tensor of layer i (layers one after another, end_layer closing each): encoded
        at once, so a layer's float copies never coexist, and written out as a part item whenever
        the layer's pending bytes reach PART_BYTES. Memory then holds one part, whatever the layer:
        an MoE layer's experts (Qwen3-30B-A3B: 2.4 GB as f32) or a wide dense layer."""
        if self._open is None:
            self._open = _OpenLayer(i, weights.layer_shapes(self.cfg, i))
        layer = self._open
        if layer.index != i:
            raise CheckpointError(f"layer {i} started before layer {layer.index} ended")
        shape = layer.shapes[key]
        if len(shape) == 1:
            stored = _vector(w, shape, f"layer {i} {key}")
        elif tuple(w.shape) != shape[::-1]:
            raise CheckpointError(f"layer {i} {key}: shape {tuple(w.shape)}, expected {shape[::-1]} [out, in]")
        else:
            stored = encode(w, stored_format(self.fmt, key))
            self._record_type(key, stored, i)
        layer.pending[key] = stored
        layer.keys.append(key)
        layer.nbytes += sum(a.nbytes for a in stored.values()) if isinstance(stored, dict) else stored.nbytes
        if layer.nbytes >= PART_BYTES:
            self._save(f"layer_{i:05d}.part{layer.parts:03d}", layer.pending)
            layer.pending, layer.nbytes, layer.parts = {}, 0, layer.parts + 1

    def end_layer(self, i: int) -> None:
        """Layer i is complete: its last item (with its part count) names it written."""
        layer = self._open or _OpenLayer(i, {})
        if layer.index != i:
            raise CheckpointError(f"end of layer {i}, but layer {layer.index} is open")
        self._check_keys(i, layer.keys)
        self._save(f"layer_{i:05d}", {**layer.pending, PARTS_KEY: np.int32(layer.parts)})
        self._open = None
        self._layers.add(i)

    def _check_keys(self, i: int, keys: Iterable[str]) -> None:
        keys, shapes = sorted(keys), sorted(weights.layer_shapes(self.cfg, i))
        if keys != shapes:
            raise CheckpointError(f"layer {i}: got keys {keys}, expected {shapes}")

    def finish(self, source: dict[str, Any]) -> None:
        """Check completeness; write format.json, source.json and (last) model.json."""
        missing = [i for i in range(self.cfg.n_layers) if i not in self._layers]
        want = {"embed": self.cfg.vocab_size, "head": 0 if self.cfg.tied_embeddings else self.cfg.vocab_size}
        short = [k for k, n in want.items() if self._rows[k] != n]
        if missing or short or "norm" not in self._top:
            raise CheckpointError(f"incomplete checkpoint: layers missing {missing[:8]}, rows incomplete {short}, "
                                  f"norm {'present' if 'norm' in self._top else 'missing'}")
        self._save("top", self._top)
        manifest = {"version": VERSION, "weights": self.fmt, "rows_per_block": self.rows_per_block, "group": GROUP,
                    "stored": {k: stored_format(self.fmt, k) for k in ("layers", "embed", "head")}}
        if self.fmt == KEEP:
            manifest["types"] = {"embed": self._types.get("embed"), "head": self._types.get("head"),
                                 "layers": [self._types["layers"].get(i, {}) for i in range(self.cfg.n_layers)]}
        (self.params / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (self.out / "source.json").write_text(json.dumps(source, indent=2) + "\n")
        self.cfg.save(self.out / "model.json")
        write_manifest(self.out)   # sha256 per file, for workers that fetch their items (cluster/)

    def _save(self, name: str, tree: dict[str, Any]) -> None:
        self._ckpt.save(self.params / name, tree, force=True)


def _vector(v: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    v = np.asarray(v, np.float32)
    if v.shape != tuple(shape):
        raise CheckpointError(f"{what}: shape {v.shape}, expected {tuple(shape)}")
    return v


def _grid_rows(e: Encoded, start: int, n: int) -> Encoded:
    return Encoded(e.fmt, e.q[start:start + n], e.d[start:start + n], e.m[start:start + n])


# ---------------------------------------------------------------- restore


def stored_weights(model_dir: Path) -> str:
    """The format a converted model's checkpoint stores ("f32" for the older single-PyTree layout)."""
    manifest = _manifest(Path(model_dir) / "params")
    return "f32" if manifest is None else manifest["weights"]


def check_runnable(stored: str, asked: str) -> None:
    """A stage may run the stored format or a coarser one; a finer one is an error that says what to do."""
    check_format(asked)
    allowed = FORMATS[FORMATS.index(stored):]
    if asked not in allowed:
        only = " only" if len(allowed) == 1 else ""
        fix = "from the GGUF without --weights (it keeps the file's types)" if asked == KEEP else f"with --weights {asked}"
        raise CheckpointError(f"checkpoint stores {stored}; a stage can run {', '.join(allowed)}{only} "
                              f"(asked for {asked}): re-convert {fix}")


def resolve_weights(model_dir: Path, asked: str | None) -> str:
    """The format a stage runs: `asked`, or (None or "auto") what the checkpoint stores."""
    return stored_weights(model_dir) if asked in (None, "auto") else asked


def kept_types(model_dir: Path, device: str = "cpu") -> KeptTypes | None:
    """Every matrix's GGUF type of a gguf checkpoint (None for any other format), as a stage on `device`
    ("cpu", "gpu:0", ...) holds them (KeptTypes.at_load)."""
    manifest = _manifest(Path(model_dir) / "params")
    if manifest is None or manifest["weights"] != KEEP:
        return None
    t = manifest.get("types")
    if not isinstance(t, dict) or not isinstance(t.get("layers"), list):
        raise CheckpointError(f"{Path(model_dir) / 'params' / MANIFEST}: a gguf checkpoint without its types: "
                              "re-convert the model")
    return KeptTypes(t.get("embed"), t.get("head"), tuple(tuple(sorted(layer.items())) for layer in t["layers"]),
                     ggml.dequantise_at_load(device), ggml.kernel_block_types(device))


def itemised(model_dir: Path) -> bool:
    """Whether the checkpoint has this layout (one item per layer, format.json), not the older single PyTree."""
    return _manifest(Path(model_dir) / "params") is not None


def stage_items(model_dir: Path, cfg: ModelConfig, start: int = 0,
                end: int | None = None) -> Iterator[tuple[str | int, Any]]:
    """The stored arrays of the items a stage [start, end) owns, one at a time: ("norm", v),
    ("head", rows), ("embed", rows) (the embedding when first, or last with a tied head; norm and
    an untied head when last), then (i, layer) for each of its layers, so a caller can convert
    each and let it go. Nothing else is read."""
    params = Path(model_dir).absolute() / "params"
    if _manifest(params) is None:
        raise CheckpointError(f"{params}: no {MANIFEST} (an older single-PyTree checkpoint: use weights.restore_params)")
    want = weights.param_shapes(cfg, start, end)
    ckpt = ocp.PyTreeCheckpointer()
    for key in ("norm", "head", "embed"):
        if key in want:
            yield key, restore_item(ckpt, params / "top")["norm"] if key == "norm" else \
                _restore_rows(ckpt, params / key, cfg.vocab_size)
    for i in sorted(want["layers"], key=int):
        yield int(i), restore_layer(ckpt, params, int(i))


def restore_layer(ckpt: Any, params: Path, i: int) -> dict[str, Any]:
    """Layer i's item with its streamed parts merged in (CheckpointWriter.put_layer_tensor)."""
    item = dict(restore_item(ckpt, params / f"layer_{i:05d}"))
    for n in range(int(item.pop(PARTS_KEY, 0))):
        item.update(restore_item(ckpt, params / f"layer_{i:05d}.part{n:03d}"))
    return item


def restore_item(ckpt: Any, path: Path) -> dict[str, Any]:
    """One orbax item; a missing, truncated or foreign one is a CheckpointError naming it."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint item missing (an interrupted copy? re-convert the model)")
    failure = None
    try:
        item = ckpt.restore(path)
    except Exception as exc:  # orbax and tensorstore raise assorted errors on damaged items
        failure = f"{path}: cannot restore checkpoint item: {exc!r}"[:2000]
    if failure is not None:
        # orbax leaves the failed restore's other tasks unretrieved, in cycles with the exception:
        # collected here, their "never retrieved" finalizers run now, not inside whatever later
        # triggers a collection (in CPython 3.11.7 one inside ast.parse, whose traceback formatting
        # parses again, raised "AST constructor recursion depth mismatch" in tests/test_layout.py)
        gc.collect()
        raise CheckpointError(failure)
    if not isinstance(item, dict) or not item:
        raise CheckpointError(f"{path}: checkpoint item holds no arrays")
    return item


def _restore_rows(ckpt: Any, directory: Path, n_rows: int) -> dict[str, np.ndarray]:
    """Row blocks -> one [V, ...] array per leaf, filled in place (no second full copy)."""
    out: dict[str, np.ndarray] = {}
    row = 0
    for block_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
        block = restore_item(ckpt, block_dir)
        for leaf, a in block.items():
            if np.ndim(a) == 0:     # a gguf block's type id: one per tensor
                out[leaf] = np.asarray(a)
                continue
            if leaf not in out:   # 64-byte aligned: jax.device_put onto the CPU then aliases it, no copy
                out[leaf] = aligned_empty((n_rows, *a.shape[1:]), a.dtype)
            out[leaf][row:row + a.shape[0]] = a
        row += next(a for a in block.values() if np.ndim(a)).shape[0]
        del block
    if row != n_rows:
        raise CheckpointError(f"{directory}: {row} rows stored, expected {n_rows}")
    return out


def aligned_empty(shape: tuple[int, ...], dtype: Any, align: int = 64) -> np.ndarray:
    """np.empty on a 64-byte boundary. JAX's CPU client adopts such a numpy buffer as it is (measured:
    device_put of an aligned 256 MiB array added 0 bytes of RSS, of numpy's default 16-byte aligned one
    256 MiB), so the embedding's rows are not held twice while a stage loads."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(n + align, np.uint8)
    offset = -buf.ctypes.data % align
    return buf[offset:offset + n].view(dtype).reshape(shape)


def release_freed_memory() -> None:
    """Hand glibc's freed heap pages back to the system (malloc_trim). Arrays under glibc's mmap
    threshold (up to 32 MiB: every layer matrix of an 8B q4 stage) are freed into the heap, which glibc
    keeps: an 8B half stage held 0.63 GiB of them after its restore. No-op off glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _manifest(params: Path) -> dict[str, Any] | None:
    path = params / MANIFEST
    if not path.is_file():
        if (params / "top").is_dir():     # item-per-layer items without their manifest: damaged
            raise CheckpointError(f"{path}: missing beside the checkpoint's items: re-convert the model")
        return None
    manifest = read_json_capped(path, MANIFEST, 1 << 20)
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if version != VERSION or manifest.get("weights") not in FORMATS:
        raise CheckpointError(f"{path}: checkpoint version {version}, this runtime reads "
                              f"{VERSION}: re-convert the model")
    return manifest
