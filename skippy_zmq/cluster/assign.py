"""From a topology and the workers that joined to what each worker runs: where its stage listens,
and the CURVE key files its stage reads.

A stage whose topology names no host of its own (a local one: the planner's default) is placed on
its worker: it binds every interface on its port and peers dial it at the worker's address (as the
driver saw the worker connect). A stage with a host or advertise of its own keeps it. Workers on
this machine (a loopback address) keep the topology's endpoints as they are.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Mapping

from skippy_zmq.config.topology import StageConfig, Topology, is_local
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.protocol.keystore import DRIVER, ensure_keys, keys_dir_of

MAX_KEY_FILE_BYTES = 4096
_KEY_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.key(_secret)?")


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def place_stage(stage: StageConfig, address: str) -> StageConfig:
    """`stage` as it runs on a worker that connected from `address`."""
    if is_loopback(address) or not is_local(stage.host) or stage.advertise is not None:
        return stage
    port = stage.listen.rsplit(":", 1)[1]
    host = f"[{address}]" if ":" in address else address
    return dataclasses.replace(stage, host=address, listen=f"tcp://0.0.0.0:{port}", advertise=f"tcp://{host}:{port}")


def placed_topology(topology: Topology, addresses: Mapping[str, str]) -> Topology:
    """The topology with every stage placed on its worker (stage id -> the worker's address), re-validated."""
    stages = tuple(place_stage(s, addresses[s.id]) for s in topology.stages)
    data = dataclasses.replace(topology, stages=stages).to_dict()
    return parse_topology(data, source=f"{topology.source} (placed on workers)")


def stage_key_files(topology: Topology, stage_id: str) -> dict[str, str]:
    """The key files a worker writes for its stage: the stage's secret and every party's public key
    (made now if this is the topology's first launch); {} with `security: none`."""
    folder = ensure_keys(topology)
    if folder is None:
        return {}
    names = [DRIVER, *(s.id for s in topology.stages)]
    wanted = [f"{stage_id}.key_secret", *(f"{name}.key" for name in names)]
    return {name: Path(keys_dir_of(topology), name).read_text() for name in wanted}


def write_key_files(folder: Path, files: Mapping[str, str]) -> None:
    """Write key files received from the driver: names checked, the folder 0700, secrets 0600."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name, text in files.items():
        if not (isinstance(name, str) and _KEY_FILE.fullmatch(name) and isinstance(text, str)
                and len(text) <= MAX_KEY_FILE_BYTES):
            raise ValueError(f"key file {str(name)[:80]!r}: not a key file name, or too long")
        path = folder / name
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o600 if name.endswith("_secret") else 0o644)
        tmp.replace(path)
