"""scripts/peers_ab.py: the rows it reads from `bench peers` JSON and the after ÷ before table."""

from __future__ import annotations

import json

import pytest
from scripts_helper import load_script


@pytest.fixture(scope="module")
def ab():
    return load_script("peers_ab")


def peers(decode: float, llama: float, one_stream: float) -> dict:
    """A `bench peers --quick` JSON's "peers" section, cut down to one row of each table."""
    return {"single": [{"engine": "skippy_zmq q4, 1 stage", "prefill_tok_s": 500.0, "decode_tok_s": decode},
                       {"engine": "llama-server", "prefill_tok_s": 300.0, "decode_tok_s": llama},
                       {"engine": "ratio ours ÷ llama.cpp", "prefill_tok_s": 1.6, "decode_tok_s": decode / llama}],
            "speculation": [{"engine": "skippy_zmq q4, 1 stage", "workload": "copy", "off_tok_s": 60.0,
                             "on_tok_s": 200.0},
                            {"engine": "llama-server", "workload": "copy", "off_tok_s": 60.0, "on_tok_s": 61.0}],
            "concurrency": [{"engine": "skippy_zmq q4, 2 stage(s)", "streams": 1, "agg_tok_s": one_stream},
                            {"engine": "llama-server -np 1", "streams": 1, "agg_tok_s": 70.0}],
            "rpc": [{"stages": 2, "hop_ms": 0.0, "ours_tok_s": 73.0, "llama_rpc_tok_s": 44.0}]}


def test_rows_name_ours_and_llama_servers_apart(ab):
    rows = ab.our_rows(peers(90.0, 100.0, 50.0))
    assert rows == {"single stream decode tok/s": 90.0, "single stream prefill tok/s": 500.0,
                    "(llama-server single stream decode)": 100.0, "speculation copy off": 60.0,
                    "speculation copy on": 200.0, "1 stream(s), 2 stage(s)": 50.0,
                    "(llama-server -np 1, 1 stream(s))": 70.0, "2 stages, 0 ms per hop": 73.0}


def test_after_over_before_is_a_ratio_of_medians(ab, tmp_path, capsys):
    runs = {"before-1": peers(80.0, 100.0, 40.0), "after-1": peers(90.0, 100.0, 44.0),
            "before-2": peers(100.0, 100.0, 50.0), "after-2": peers(120.0, 100.0, 46.0)}
    text, ratios = ab.table({n: ab.our_rows(p) for n, p in runs.items()})
    assert ratios["single stream decode tok/s"] == pytest.approx(105.0 / 90.0)
    assert ratios["1 stream(s), 2 stage(s)"] == pytest.approx(45.0 / 45.0)
    assert ratios["(llama-server single stream decode)"] == 1.0
    assert "| single stream decode tok/s | 80 | 90 | 100 | 120 | 1.167 |" in text.splitlines()
    # --table reads the folders a run wrote
    for name, p in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps({"peers": p}))
    assert ab.main(["--table", *(str(tmp_path / n) for n in runs)]) == 0
    assert capsys.readouterr().out.strip() == text


def test_a_table_needs_both_codes(ab):
    with pytest.raises(SystemExit, match="before"):
        ab.table({"after-1": ab.our_rows(peers(90.0, 100.0, 44.0))})
