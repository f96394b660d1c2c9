"""Live events from a running Tessera monitor (``docs/monitor-protocol.md``)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional

from . import _native
from ._events import Event


class Consumer:
    """A consumer attached to one station of a monitor.

    The Rust client underneath beats to the monitor from its own thread, so a consumer busy with
    an event is not taken for dead, and, with ``reattach`` (the default), connects and attaches
    again by itself when the system restarts: an event display can be left running.

    At a blocking station every event must be put back (``put``) before it moves on; at a
    sampling station events are copies and ``put`` does nothing.
    """

    def __init__(self, addr: str, station: str = "sample", name: Optional[str] = None,
                 create: Optional[Dict[str, Any]] = None, reattach: bool = True,
                 token: Optional[str] = None):
        self.addr = addr
        self.station = station
        name = name or f"python pid {os.getpid()}"
        self._c = _native.ConsumerPy(addr, station, name,
                                     json.dumps(create) if create is not None else None, reattach,
                                     token)

    @property
    def settings(self) -> Dict[str, Any]:
        """The station's settings as the monitor reported them."""
        s = self._c.station_json()
        return json.loads(s) if s else {}

    @property
    def blocking(self) -> bool:
        return self.settings.get("mode") == "blocking"

    @property
    def instance(self) -> int:
        """The monitor incarnation this consumer is attached to."""
        return self._c.state()[0]

    @property
    def restarts(self) -> int:
        """Times the consumer found a restarted monitor and reattached."""
        return self._c.state()[2]

    @property
    def connected(self) -> bool:
        return self._c.state()[3]

    def get(self, max: int = 100, timeout: Optional[float] = None) -> List[Event]:  # noqa: A002
        """Up to ``max`` events. ``timeout=None`` waits for at least one, ``0`` polls, else waits
        up to that many seconds (an empty list: none came)."""
        return [Event.from_record(rec, seq) for seq, rec in self._c.get(max, timeout)]

    def put(self, events: List[Event]) -> None:
        """Gives events back to the station (a blocking station passes them on only then).
        The put goes with the next ``get`` or ``close``, or alone 20 ms later at most."""
        self._c.put([e.seq for e in events if e.seq is not None])

    def events(self, timeout: Optional[float] = 1.0, max: int = 100) -> Iterator[Event]:  # noqa: A002
        """Events one by one, for ever (each is put back once the loop moves past it)."""
        while True:
            batch = self.get(max, timeout)
            for e in batch:
                yield e
            self.put(batch)

    def close(self) -> None:
        """Detaches cleanly."""
        self._c.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(addr: str = "127.0.0.1:7711", station: str = "sample", name: Optional[str] = None,
           create: Optional[Dict[str, Any]] = None, reattach: bool = True,
           token: Optional[str] = None) -> Consumer:
    """Attaches to a station of the monitor at ``addr`` (the demo's is 127.0.0.1:7711; a run
    writes its address to ``monitor.addr`` in its output directory). ``create`` gives settings
    to create the station with if it does not exist, e.g. ``{"name": "mine", "mode":
    "sampling", "prescale": 10, "trigger_types": [1]}``. ``token``: the run control's, which a
    monitor listening beyond loopback (on the recorder's host of a run spread over hosts) asks
    for; default: the environment variable ``TESSERA_TOKEN``."""
    return Consumer(addr, station, name, create, reattach, token)


def monitor_command(addr: str, command: Dict[str, Any], timeout: float = 5.0) -> Dict[str, Any]:
    """Sends one JSON command (``status``, ``create``, ``set``, ``remove``) and returns the
    answer; a refusal raises ``ConnectionError`` with the monitor's reason."""
    return json.loads(_native.monitor_command(addr, json.dumps(command), timeout))


def monitor_status(addr: str = "127.0.0.1:7711") -> Dict[str, Any]:
    """Stations, queue depths, counters and consumers of a running monitor."""
    return monitor_command(addr, {"op": "status"})
