"""The example scripts run against a real run's files and a real monitor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import tessera_bin, write_config
from test_monitor import wait_for_addr

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_run_table_counts_every_event(recorded_run, tmp_path):
    csv = tmp_path / "events.csv"
    out = subprocess.run([sys.executable, str(EXAMPLES / "run_table.py"), str(recorded_run),
                          "--csv", str(csv)], check=True, capture_output=True, text=True).stdout
    assert "3000 events" in out
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("event_id,trigger_type,size")
    assert len(lines) == 3001


def test_live_histogram_watches_a_running_system(tmp_path):
    cfg = write_config(tmp_path, events=30000, rate=2000.0)
    proc = subprocess.Popen([tessera_bin(), "run", str(cfg), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = wait_for_addr(tmp_path / "data", proc)
        out = subprocess.run([sys.executable, str(EXAMPLES / "live_histogram.py"), "--addr", addr,
                              "--seconds", "3", "--every", "1"],
                             check=True, capture_output=True, text=True, timeout=60).stdout
    finally:
        proc.communicate(timeout=120)
    assert "events sampled" in out
    for src in range(4):
        assert f"source {src:>4}:" in out
