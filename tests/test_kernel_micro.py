"""bench/kernel_micro: the block loops' micro-bench builds from the kernel's own sources and reports
one row per GGUF block type beside the q4 panel loops, with the shape it ran (K-quants skipped
where K is not a multiple of 256)."""

from __future__ import annotations

import os
import shutil

import pytest

from skippy_zmq.devtools.bench import kernel_micro


@pytest.mark.skipif(not shutil.which(os.environ.get("CXX") or "g++"), reason="no C++ compiler")
def test_micro_bench_reports_every_type_per_shape():
    rows = kernel_micro.run("generic", 2, "64x256,64x96")
    got = [(r["type"], r["M"], r["N"], r["K"]) for r in rows]
    panels = ("q4 panels (Q4_0 / Q4_1)", "q5 panels (Q5_0 at load)")
    blocks = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_1")
    assert got == [(t, 2, 64, 256) for t in (*panels, *blocks)] + \
                  [(t, 2, 64, 96) for t in (*panels, "Q5_0", "Q8_0", "IQ4_NL", "Q5_1")]
    assert all(r["us"] > 0 and r["gb_s"] > 0 and r["gweights_s"] > 0 for r in rows)
