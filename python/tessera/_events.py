"""Events and fragments: thin views over one ``bytes`` buffer (a file block or a monitor batch)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native


class EventFlags:
    """Bits of an event record's flags (``docs/file-format.md``)."""

    INCOMPLETE = 1 << 0
    TRIGGER_MISMATCH = 1 << 1
    FRONT_END_STATUS = 1 << 2
    REBUILT = 1 << 3

    NAMES = {
        INCOMPLETE: "incomplete",
        TRIGGER_MISMATCH: "trigger_mismatch",
        FRONT_END_STATUS: "front_end_status",
        REBUILT: "rebuilt",
    }

    @classmethod
    def names(cls, flags: int) -> List[str]:
        """The names of the bits set in ``flags``."""
        return [n for bit, n in cls.NAMES.items() if flags & bit]


class Fragment:
    """One source's fragment of an event.

    ``payload`` is a read-only numpy ``uint8`` array that shares memory with the buffer the
    event came in (no copy); ``payload_as(np.uint32)`` reinterprets it.
    """

    __slots__ = ("source_id", "event_id", "trigger_type", "status", "_buf", "_start", "_len", "_fstart", "_flen")

    def __init__(self, buf: bytes, t: Tuple[int, int, int, int, int, int, int, int]):
        (self.source_id, self.event_id, self.trigger_type, self.status,
         self._start, self._len, self._fstart, self._flen) = t
        self._buf = buf

    @property
    def payload(self) -> np.ndarray:
        """The payload bytes as a numpy ``uint8`` view (read-only, no copy)."""
        return np.frombuffer(self._buf, dtype=np.uint8, count=self._len, offset=self._start)

    def payload_as(self, dtype: "np.typing.DTypeLike") -> np.ndarray:
        """The payload reinterpreted as ``dtype`` (little-endian words, as sources send them);
        trailing bytes that do not fill a whole item are left out."""
        dt = np.dtype(dtype).newbyteorder("<")
        n = self._len // dt.itemsize
        return np.frombuffer(self._buf, dtype=dt, count=n, offset=self._start)

    @property
    def size(self) -> int:
        """Payload size in bytes."""
        return self._len

    @property
    def raw(self) -> memoryview:
        """The whole fragment as on the wire (header, payload, trailer)."""
        return memoryview(self._buf)[self._fstart:self._fstart + self._flen]

    def __repr__(self) -> str:
        return f"Fragment(source_id={self.source_id}, event_id={self.event_id}, size={self._len})"


class Event:
    """One built event: header fields, and its fragments parsed on first use."""

    __slots__ = ("event_id", "trigger_type", "flags", "fragment_count", "builder_id",
                 "timestamp", "missing", "size", "_buf", "_offset", "_fragments", "seq")

    def __init__(self, buf: bytes, t: Sequence, seq: Optional[int] = None):
        (self._offset, self.size, self.event_id, self.trigger_type, self.flags,
         self.fragment_count, self.builder_id, self.timestamp, missing) = t
        self.missing: List[int] = list(missing)
        self._buf = buf
        self._fragments: Optional[List[Fragment]] = None
        #: The monitor's sequence number (live events only).
        self.seq = seq

    @classmethod
    def from_record(cls, record: bytes, seq: Optional[int] = None) -> "Event":
        """An event from one whole event record (as a monitor delivers it)."""
        return cls(record, _native.event_header(record), seq)

    @property
    def fragments(self) -> List[Fragment]:
        """The fragments, in the order the record holds them."""
        if self._fragments is None:
            self._fragments = [Fragment(self._buf, t)
                               for t in _native.fragments(self._buf, self._offset, self.size)]
        return self._fragments

    def fragment(self, source_id: int) -> Optional[Fragment]:
        """The fragment of one source, or None if the event has none from it."""
        for f in self.fragments:
            if f.source_id == source_id:
                return f
        return None

    def payloads(self) -> Dict[int, np.ndarray]:
        """Every payload by source ID (numpy views, no copy)."""
        return {f.source_id: f.payload for f in self.fragments}

    @property
    def record(self) -> memoryview:
        """The whole event record."""
        return memoryview(self._buf)[self._offset:self._offset + self.size]

    @property
    def incomplete(self) -> bool:
        return bool(self.flags & EventFlags.INCOMPLETE)

    @property
    def flag_names(self) -> List[str]:
        return EventFlags.names(self.flags)

    def __repr__(self) -> str:
        extra = f", flags={self.flag_names}" if self.flags else ""
        return (f"Event(event_id={self.event_id}, trigger_type={self.trigger_type}, "
                f"size={self.size}, fragments={self.fragment_count}{extra})")
