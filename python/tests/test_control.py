"""The run control's HTTP service of a running `tessera run --control`: the API against its
OpenAPI document (schemathesis), the metrics through a Prometheus text parser."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, tessera_bin, write_config

FAST_STOP = """
[stop]
sources_ms = 3000
readout_ms = 3000
builders_ms = 3000
recorder_ms = 3000
abort_grace_ms = 1000
"""


def call(base, method, path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw and r.headers.get_content_type() == "application/json" else raw.decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.fixture
def control(tmp_path):
    # events = 0: a run goes until it is stopped.
    cfg = write_config(tmp_path, events=0, rate=2000.0, extra=FAST_STOP)
    out = tmp_path / "data"
    proc = subprocess.Popen([tessera_bin(), "run", str(cfg), "--control", "--quiet",
                             "--http", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not (out / "control.addr").exists() or not (out / "control.addr").read_text().strip():
            if proc.poll() is not None:
                pytest.fail(f"tessera run ended early: {proc.stderr.read()}")
            if time.time() - t0 > 60:
                pytest.fail("no control.addr")
            time.sleep(0.05)
        yield "http://" + (out / "control.addr").read_text().strip(), out
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_events(base, at_least=1, limit=30.0):
    t0 = time.time()
    while time.time() - t0 < limit:
        _, v = call(base, "GET", "/api/live")
        if v["live"] and sum(b["events_complete"] + b["events_incomplete"]
                             for b in v["live"]["builders"]) >= at_least:
            return v
        time.sleep(0.1)
    pytest.fail("no events built")


def test_metrics_parse_with_a_prometheus_text_parser(control):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    base, _ = control
    code, v = call(base, "POST", "/api/transitions/start", {"comment": "metrics test"},
                   headers={"X-Tessera-Operator": "pytest"})
    assert code == 200 and v["state"] == "running", v
    wait_events(base, 100)
    time.sleep(1.2)  # two samples: the rates and fractions exist
    # Prometheus asks for OpenMetrics first, and gets it.
    req = urllib.request.Request(base + "/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers.get_content_type() == "application/openmetrics-text"
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # A client that names no format gets the text format 0.0.4, which its own parser reads.
    from prometheus_client.parser import text_string_to_metric_families as text_0_0_4
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        assert r.headers.get_content_type() == "text/plain"
        plain = {f.name: f for f in text_0_0_4(r.read().decode())}
    assert plain["tessera_builder_events"].type == "counter"
    assert "tessera_state" in plain
    assert all(n.startswith("tessera_") for n in families), list(families)
    for name, kind in [
        ("tessera_state", "gauge"),
        ("tessera_source_fragments", "counter"),
        ("tessera_source_bytes", "counter"),
        ("tessera_source_dead_time_seconds", "counter"),
        ("tessera_readout_bytes", "counter"),
        ("tessera_readout_buffer_occupancy", "gauge"),
        ("tessera_readout_busy_fraction", "gauge"),
        ("tessera_builder_events", "counter"),
        ("tessera_builder_bytes", "counter"),
        ("tessera_builder_busy_fraction", "gauge"),
        ("tessera_builder_event_latency_seconds", "histogram"),
        ("tessera_incomplete_events", "counter"),
        ("tessera_recorder_bytes", "counter"),
        ("tessera_recorder_files", "counter"),
        ("tessera_source_dead_time_fraction", "gauge"),
    ]:
        assert name in families, f"{name} missing"
        assert families[name].type == kind, (name, families[name].type)
    # Every series names its host.
    host = open("/proc/sys/kernel/hostname").read().strip()
    assert all(s.labels.get("host") == host for f in families.values() for s in f.samples)
    state = {s.labels["state"]: s.value for s in families["tessera_state"].samples}
    assert state["running"] == 1 and sum(state.values()) == 1
    src = [s for s in families["tessera_source_fragments"].samples if s.name.endswith("_total")]
    assert len(src) == 4 and all(s.value > 0 for s in src)
    assert {s.labels["readout_unit"] for s in src} <= {"0", "1"}
    built = sum(s.value for s in families["tessera_builder_events"].samples
                if s.name.endswith("_total") and s.labels["outcome"] == "complete")
    assert built >= 100
    lat = families["tessera_builder_event_latency_seconds"].samples
    inf = [s for s in lat if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    count = [s for s in lat if s.name.endswith("_count")]
    assert inf and [s.value for s in inf] == [s.value for s in count]
    assert sum(s.value for s in count) > 0
    code, v = call(base, "POST", "/api/transitions/stop")
    assert code == 200 and v["state"] == "stopped", v


def test_the_api_against_its_openapi_document(control, tmp_path):
    base, out = control
    # Served document and the one in the repository are the same.
    code, served = call(base, "GET", "/openapi.json")
    assert code == 200
    assert served == json.loads((ROOT / "docs" / "openapi.json").read_text())
    # A run, so that the run database and the live view have something to show.
    call(base, "POST", "/api/transitions/start")
    wait_events(base, 10)
    code, why = call(base, "GET", "/api/events/5/why")
    assert code == 200 and why["event_id"] == 5, why
    code, rep = call(base, "GET", "/api/report")
    assert code == 200 and rep["run_number"] == 1
    call(base, "POST", "/api/transitions/stop", {"comment": "first"})
    code, runs = call(base, "GET", "/api/runs")
    assert code == 200 and runs[0]["number"] == 1 and runs[0]["comment"] == "first"
    # Illegal: a clear refusal.
    code, e = call(base, "POST", "/api/transitions/resume")
    assert code == 409 and "cannot resume in state stopped" in e["error"], e

    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert st, "schemathesis is installed beside this Python (pip install schemathesis)"
    p = subprocess.run(
        [st, "run", base + "/openapi.json", "--url", base, "--checks", "all",
         "--exclude-checks", "ignored_auth,use_after_free,ensure_resource_availability",
         "--phases", "examples,coverage,fuzzing", "--max-examples", "15", "--workers", "1",
         "--no-color", "--suppress-health-check", "all", "--max-failures", "20"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-8000:] + p.stderr[-3000:]
