"""Attaching to the monitor of a running `tessera run` from Python."""

from __future__ import annotations

import subprocess
import time

import pytest

import tessera
from conftest import tessera_bin, write_config


def wait_for_addr(out, proc, limit=60.0):
    t0 = time.time()
    while time.time() - t0 < limit:
        p = out / "monitor.addr"
        if p.exists() and p.read_text().strip():
            return p.read_text().strip()
        if proc.poll() is not None:
            pytest.fail(f"tessera run ended early: {proc.stderr.read()}")
        time.sleep(0.05)
    pytest.fail("the run never wrote monitor.addr")


def test_live_events_from_a_sampling_and_a_blocking_station(tmp_path):
    # 2000 events/s for 40000 events: the run lasts long enough to attach and watch it.
    cfg = write_config(tmp_path, events=40000, rate=2000.0)
    proc = subprocess.Popen([tessera_bin(), "run", str(cfg), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = wait_for_addr(tmp_path / "data", proc)
        status = tessera.monitor_status(addr)
        assert [s["config"]["name"] for s in status["stations"]] == ["sample"]
        # A token is what a monitor beyond loopback asks for; one on loopback takes it too.
        with tessera.attach(addr, "sample", name="pytest sampler", token="t0ken") as sampler:
            assert not sampler.blocking
            got = []
            while len(got) < 20:
                got += sampler.get(10, timeout=5.0)
            for e in got:
                assert e.fragment_count == 4 and len(e.fragments) == 4
                assert e.size == len(e.record)
        # A blocking station created on attach: every event in order of arrival (the monitor's
        # sequence numbers, one after the other: none skipped), each put back.
        with tessera.attach(addr, "every", create={"name": "every", "mode": "blocking",
                                                  "queue": 50}) as every:
            assert every.blocking
            seqs, ids = [], []
            while len(seqs) < 500:
                batch = every.get(100, timeout=5.0)
                seqs += [e.seq for e in batch]
                ids += [e.event_id for e in batch]
                every.put(batch)
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert len(set(ids)) == len(ids)
        # A refused option comes back with the monitor's reason.
        with pytest.raises(ConnectionError, match="sampling"):
            tessera.monitor_command(addr, {"op": "set", "station": {"name": "sample",
                                                                   "restore": "next"}})
    finally:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "balance holds" in out
