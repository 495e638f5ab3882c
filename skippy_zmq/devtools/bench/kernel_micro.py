"""Micro-bench of the native kernel's matrix loops (kernel_micro.cc): per GGUF block type, the block
loops beside the q4 panel loops (Q4_0 / Q4_1) on the same shape, one thread, no XLA; bytes/s of the
weights and weights/s. Built here from the kernel's own sources with its flags, into a temp folder.

    python -m skippy_zmq.devtools.bench.kernel_micro [--isa avx512] [--rows 1] [--shapes 1536x576,...]

Default shapes: SmolLM2-135M's (ffn up 1536x576, down 576x1536, the tied head 49152x576) and the
Llama-3.2-1B shape's (ffn up 8192x2048, down 2048x8192). Figures from a shared machine are the fastest
of 9 short runs per slice (kernel_micro.cc), weights warm in cache: the loops' speed, not memory's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from skippy_zmq.model.kernel import CXX_FLAGS, INT8_ISAS, ISA_FLAGS, ISA_SOURCES, KERNEL_DIR, _compile_all, kernel_isas

SOURCE = Path(__file__).with_name("kernel_micro.cc")
SHAPES = "1536x576,576x1536,49152x576,8192x2048,2048x8192"
TIMEOUT_S = 600


def build(out: Path, isa: str) -> Path:
    """The micro-bench linked with `isa`'s loop objects (the kernel's sources and flags)."""
    cxx = shutil.which(os.environ.get("CXX") or "g++") or "c++"
    units = {str(out / f"{Path(source).stem}.o"): (*ISA_FLAGS[isa], f"-DSKIPPY_ISA={isa}", str(KERNEL_DIR / source))
             for source in ISA_SOURCES}
    _compile_all(cxx, units)   # the kernel's own parallel compile
    binary = out / "kernel_micro"
    types = {"avx512vnni": "skippy_int8_block_type", "avx2int8": "skippy_int8_block_type_avx2"}.get(isa)
    quantize = ["-DSKIPPY_MICRO_QUANTIZE", f"-DSKIPPY_MICRO_INT8_TYPES={types}"] if types else []   # (int8 x)
    subprocess.run([cxx, *CXX_FLAGS, f"-DSKIPPY_MICRO_ISA={isa}", *quantize, "-I", str(KERNEL_DIR), str(SOURCE),
                    *units, "-o", str(binary)], check=True, timeout=TIMEOUT_S)
    return binary


def run(isa: str, rows: int, shapes: str) -> list[dict]:
    """One row per (shape, loops): type, M, N, K, us, gb_s, gweights_s."""
    with tempfile.TemporaryDirectory(prefix="skippy-kernel-micro-") as tmp:
        binary = build(Path(tmp), isa)
        out = subprocess.run([str(binary), str(rows), *shapes.split(",")], check=True, capture_output=True,
                             text=True, timeout=TIMEOUT_S).stdout
    return [json.loads(line) for line in out.splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    isas = [i for i in kernel_isas() if i not in INT8_ISAS]   # (the default: float activations)
    parser.add_argument("--isa", default=isas[0], choices=list(ISA_FLAGS),
                        help="loops to measure (this CPU must run them); avx512vnni, avx2int8: their int8 block types on "
                             "int8 activations, their other loops float (avx512's, avx2's)")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: a decode step)")
    parser.add_argument("--shapes", default=SHAPES, help="NxK,... (N a multiple of 64, K of 32)")
    args = parser.parse_args()
    for row in run(args.isa, args.rows, args.shapes):
        print(f"{row['type']:>24} M={row['M']} N={row['N']:>6} K={row['K']:>5} {row['us']:>9.1f} us "
              f"{row['gb_s']:>6.2f} GB/s {row['gweights_s']:>6.2f} Gweights/s")


if __name__ == "__main__":
    main()
