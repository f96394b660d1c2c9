"""Shared fixtures: the `tessera` binary and a run recorded by it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Runs started by the tests take a free port for their HTTP service, never the default 8080.
os.environ.setdefault("TESSERA_HTTP", "127.0.0.1:0")


def tessera_bin() -> str:
    b = os.environ.get("TESSERA_BIN") or str(ROOT / "target" / "release" / "tessera")
    if not Path(b).exists():
        pytest.fail(f"{b} not found: build it (cargo build --release) or set TESSERA_BIN")
    return b


SMALL = """
[run]
events = {events}
output = "{out}"
mode = "push"
[sources]
count = 4
fragment_size = "2 KiB"
size_spread = "1 KiB"
trigger = "{trigger}"
rate_hz = {rate}
[recorder]
compression = "{compression}"
max_file_size = "8 MiB"
block_size = "256 KiB"
fsync = false
[monitor]
listen = "127.0.0.1:0"
"""


def write_config(tmp: Path, **kw) -> Path:
    kw.setdefault("events", 3000)
    kw.setdefault("trigger", "periodic" if "rate" in kw else "unlimited")
    kw.setdefault("rate", 1000.0)
    kw.setdefault("compression", "lz4")
    kw.setdefault("out", str(tmp / "data"))
    cfg = tmp / "topology.toml"
    cfg.write_text(SMALL.format(**kw) + kw.get("extra", ""))
    return cfg


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    cfg = write_config(tmp)
    p = subprocess.run([tessera_bin(), "run", str(cfg), "--quiet"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return tmp / "data"


def verify_json(path: Path) -> dict:
    out = subprocess.run([tessera_bin(), "verify", "--json", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)
