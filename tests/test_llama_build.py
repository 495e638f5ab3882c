"""The peers' build (skippy_zmq.devtools.bench.llama_build): the ISA options chosen from a CPU's flags and the AMX
probe's verdict, the cache keyed by those options, and (slow, where `make peers` has built them here)
the binaries working on the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from skippy_zmq.devtools.bench import llama_build
from skippy_zmq.devtools.bench.llama_build import AMX_OPTIONS, X86_OPTIONS, amx_probe, cpu_flags, isa_options

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# /proc/cpuinfo's flags on the VM where GGML_NATIVE builds died at `tilezero` (Xeon, AVX-512, AMX listed)
SAPPHIRE = frozenset(
    "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512ifma avx512cd "
    "avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq amx_bf16 avx512_fp16 amx_tile amx_int8".split())
AVX2_ONLY = frozenset("sse4_2 avx f16c fma bmi2 avx2".split())


def test_cpu_flags_reads_the_first_processor():
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(text) == {"fpu", "avx2", "amx_tile"}
    assert cpu_flags("processor\t: 0\nmodel name\t: some arm\n") == frozenset()


def test_native_where_amx_is_absent_or_runs():
    assert isa_options(AVX2_ONLY, amx_usable=False) == {"GGML_NATIVE": "ON"}
    assert isa_options(SAPPHIRE, amx_usable=True) == {"GGML_NATIVE": "ON"}
    assert isa_options(frozenset(), amx_usable=False) == {"GGML_NATIVE": "ON"}      # not x86: llama.cpp's own


def test_amx_listed_but_unusable_names_every_other_extension():
    options = isa_options(SAPPHIRE, amx_usable=False)
    assert options["GGML_NATIVE"] == "OFF"
    assert set(options) == {"GGML_NATIVE", *X86_OPTIONS, *AMX_OPTIONS}
    assert {k for k, v in options.items() if v == "ON"} == set(X86_OPTIONS)      # this CPU has all of them
    assert [options[k] for k in AMX_OPTIONS] == ["OFF", "OFF", "OFF"]
    # GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw}: one missing turns it off, the rest stay on
    partial = isa_options(SAPPHIRE - {"avx512vl", "avx_vnni"}, amx_usable=False)
    assert partial["GGML_AVX512"] == partial["GGML_AVX_VNNI"] == "OFF"
    assert partial["GGML_AVX512_VNNI"] == partial["GGML_AVX2"] == "ON"


def test_avx2_build_names_only_what_an_avx2_host_has():
    """SKIPPY_PEERS_ISA=avx2 on an AVX-512 CPU (with AMX, usable or not): AVX2, FMA, F16C, BMI2, AVX and
    SSE4.2 on, every AVX-512 extension, AVX-VNNI and AMX off; an older CPU only those of them it lists."""
    for amx_usable in (True, False):
        options = isa_options(SAPPHIRE, amx_usable, isa="avx2")
        assert set(options) == {"GGML_NATIVE", *X86_OPTIONS, *AMX_OPTIONS} and options["GGML_NATIVE"] == "OFF"
        assert {k for k, v in options.items() if v == "ON"} == set(llama_build.AVX2_OPTIONS)
    older = isa_options(frozenset({"sse4_2", "avx"}), False, isa="avx2")
    assert {k for k, v in older.items() if v == "ON"} == {"GGML_SSE42", "GGML_AVX"}


def test_peers_isa_picks_the_build_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPPY_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv(llama_build.PEERS_ISA_ENV, raising=False)
    assert llama_build.peers_isa() == "native" and llama_build.cache_dir() == tmp_path / "peers"
    monkeypatch.setenv(llama_build.PEERS_ISA_ENV, "AVX2")
    assert llama_build.peers_isa() == "avx2" and llama_build.cache_dir() == tmp_path / "peers-avx2"
    assert llama_build.cache_dir("native") == tmp_path / "peers"
    options, host = llama_build.host_options()
    assert options["GGML_NATIVE"] == "OFF" and options["GGML_AVX512"] == "OFF" and host["peers_isa"] == "avx2"
    monkeypatch.setenv(llama_build.PEERS_ISA_ENV, "avx512")
    with pytest.raises(SystemExit, match="SKIPPY_PEERS_ISA='avx512' is not one of native, avx2"):
        llama_build.peers_isa()


def test_probe_that_cannot_compile_or_run_says_amx_is_unusable(tmp_path):
    assert amx_probe("false") == (False, "false cannot compile the probe: ")
    usable, seen = amx_probe(str(tmp_path / "no-such-compiler"))
    assert not usable and seen.startswith("probe did not run: [Errno 2]")


def test_a_build_for_other_options_is_stale(tmp_path):
    native = {**llama_build.CMAKE_OPTIONS, **isa_options(AVX2_ONLY, False)}
    named = {**llama_build.CMAKE_OPTIONS, **isa_options(SAPPHIRE, False)}
    record = {"version": llama_build.SDIST_VERSION, "seconds": 1.0, "options": native}
    (tmp_path / "build.json").write_text(json.dumps(record))
    assert llama_build.built(tmp_path, native) is None          # the record alone is not a build
    for path in llama_build.binary_paths(tmp_path).values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    found = llama_build.built(tmp_path, native)
    assert set(found["binaries"]) == {"llama-server", "llama-bench", "llama-quantize", "rpc-server"}
    assert llama_build.built(tmp_path, named) is None           # the same binaries, built for other flags


def test_configure_names_each_option(tmp_path):
    options = {**llama_build.CMAKE_OPTIONS, **isa_options(SAPPHIRE, False)}
    configure = llama_build.configure_command("cmake", "ninja", tmp_path / "src", tmp_path / "b", options)
    assert "-DGGML_NATIVE=OFF" in configure and "-DGGML_AMX_INT8=OFF" in configure
    assert "-DGGML_AVX512_VNNI=ON" in configure and "-DLLAMA_USE_PREBUILT_UI=OFF" in configure
    assert llama_build.build_command("cmake", tmp_path / "b", 2)[-4:] == list(llama_build.BINARIES.values())


@pytest.mark.slow
@pytest.mark.skipif(llama_build.built() is None, reason="the peers are not built here (make peers)")
@pytest.mark.skipif(not GGUF.is_file(), reason=f"no GGUF at {GGUF} (make model)")
def test_the_built_peers_serve_and_quantize_smollm2(tmp_path):
    import httpx

    from skippy_zmq.devtools.bench.peers_engines import llama_server
    from skippy_zmq.devtools.harness import free_base_port

    binaries = llama_build.built()["binaries"]
    with llama_server(binaries["llama-server"], GGUF, free_base_port(1), tmp_path, context=256) as base:
        r = httpx.post(base + "/completions", timeout=120.0,
                       json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"].strip()
    out = tmp_path / "q8.gguf"
    quantize = subprocess.run([binaries["llama-quantize"], "--allow-requantize", str(GGUF), str(out), "Q8_0", "2"],
                              capture_output=True, text=True, timeout=300)
    assert quantize.returncode == 0, quantize.stdout[-2000:] + quantize.stderr[-2000:]
    assert out.read_bytes()[:4] == b"GGUF" and out.stat().st_size > GGUF.stat().st_size   # 8.5 bits > 5
