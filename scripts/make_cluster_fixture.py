"""A `bench cluster` run's cluster.json as a tests/fixtures/cluster_*_run.json: each host's lone and
all-busy measurements, its link to the driver, the one-stage ring's driver and hop software, and
every split as run (what tests/test_speed_quota.py's quiet_run rebuilds predictions from).

    .venv/bin/python scripts/make_cluster_fixture.py bench-out/cluster.json \
        tests/fixtures/cluster_NAME_run.json "what the run was: command, machine, load, date"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HOST_KEYS = ("name", "prefill", "cpu_quota_cores", "cpu_period_ms", "cores", "cpu", "layers", "stack_layers")
SPLIT_KEYS = ("split", "layers", "ms_per_token_1", "tok_s_8", "predicted_ms_1", "predicted_tok_s_8", "step_ms_1",
              "predicted_step_ms_1", "step_ms_8", "predicted_step_ms_8")


def fixture(bench: dict, about: str) -> dict:
    hosts = {}
    for h in bench["hosts"]:
        alone = {k: h[k] for k in HOST_KEYS if k in h}
        alone["decode"] = h.get("decode_alone", h["decode"])
        hosts[h["name"]] = {"alone": alone, "together": {"decode": h["decode_together"]}}
    return {"about": about, "n_layers": bench["hosts"][0]["layers"], "row_bytes": 4 * _d_model(bench),
            "streams": 8,
            "links": [{k: h["link"][k] for k in ("host", "rtt_ms", "bytes_per_s")} for h in bench["hosts"]],
            "ring": {k: bench["ring"][k] for k in ("driver_ms", "hop_fixed_ms")}, "hosts": hosts,
            "splits": [{k: s.get(k) for k in SPLIT_KEYS} for s in bench["splits"]]}


def _d_model(bench: dict) -> int:
    model = Path(bench["hosts"][0]["model"]) / "model.json"
    return int(json.loads(model.read_text())["d_model"]) if model.is_file() else 576   # SmolLM2-135M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cluster_json", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("about")
    args = ap.parse_args()
    args.out.write_text(json.dumps(fixture(json.loads(args.cluster_json.read_text()), args.about), indent=1) + "\n")


if __name__ == "__main__":
    main()
