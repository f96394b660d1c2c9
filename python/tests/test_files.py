"""Reading files written by a real run: the same counts and payload bytes as `tessera verify`."""

from __future__ import annotations

import numpy as np
import pytest

import tessera
from conftest import verify_json


def test_event_count_and_payload_bytes_match_verify(recorded_run):
    report = verify_json(recorded_run)
    assert report["events"] == 3000
    events = fragments = payload = 0
    ids = []
    for path in tessera.files_of(recorded_run):
        with tessera.open(path) as f:
            assert f.header["codec"] == "lz4"
            for e in f:
                events += 1
                ids.append(e.event_id)
                assert len(e.fragments) == e.fragment_count == 4
                for frag in e.fragments:
                    assert frag.event_id == e.event_id
                    fragments += 1
                    payload += int(frag.payload.size)
            # The trailer is there after the last event, and its CRC matched what was read.
            assert f.trailer["crc_ok"]
            assert f.trailer["events"] == f.metadata["events"]
    assert events == report["events"]
    assert fragments == report["fragments"]
    assert payload == report["payload_bytes"]
    assert sorted(ids) == list(range(min(ids), min(ids) + 3000))


def test_payloads_are_views_not_copies(recorded_run):
    path = tessera.files_of(recorded_run)[0]
    with tessera.open(path) as f:
        e = next(iter(f))
        a = e.fragments[0].payload
        b = e.fragments[1].payload
        # Two payloads of one event share the block's buffer.
        assert a.base is not None and not a.flags.writeable
        assert np.shares_memory(np.frombuffer(a.base, dtype=np.uint8), b)
        words = e.fragments[0].payload_as(np.uint32)
        assert words.size == e.fragments[0].size // 4
        assert words.tobytes() == a[: words.size * 4].tobytes()


def test_a_run_reads_as_one_stream_with_sidecars(recorded_run):
    run = tessera.open_run(recorded_run)
    assert len(run.metadata) == len(run.files) >= 2  # 8 MiB files: the run rotated
    assert sum(m["events"] for m in run.metadata) == sum(1 for _ in run)


def test_a_damaged_file_raises_at_the_damage(recorded_run, tmp_path):
    src = tessera.files_of(recorded_run)[0]
    cut = tmp_path / src.name
    data = src.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError):
        with tessera.open(cut) as f:
            for _ in f:
                pass
    with pytest.raises(OSError):
        tessera.open(tmp_path / "absent.tsr")
