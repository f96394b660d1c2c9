"""Tessera from Python: read recorded files and watch a running system.

Files::

    import tessera
    with tessera.open("data/run000001_0000.tsr") as f:
        for event in f:
            for frag in event.fragments:
                frag.payload          # numpy uint8 view into the block, no copy

Live events from a monitor station::

    with tessera.attach("127.0.0.1:7711", station="sample") as consumer:
        for event in consumer.events(timeout=1.0):
            ...

The formats are parsed by the same Rust code as the ``tessera`` binary (``tessera._native``);
this layer only turns offsets into numpy views.
"""

from __future__ import annotations

from ._events import Event, Fragment, EventFlags
from ._files import File, Run, open, open_run, files_of
from ._monitor import Consumer, attach, monitor_status, monitor_command

__all__ = [
    "Event",
    "EventFlags",
    "Fragment",
    "File",
    "Run",
    "open",
    "open_run",
    "files_of",
    "Consumer",
    "attach",
    "monitor_status",
    "monitor_command",
]
