"""Recorded files (``docs/file-format.md``): one file, or every file of a run."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

from . import _native
from ._events import Event

PathLike = Union[str, "os.PathLike[str]"]


class File:
    """One recorded ``.tsr`` file. Iterating yields its events in order.

    Use it as a context manager (``with tessera.open(path) as f``). Reading checks what the
    format promises as it goes (block CRCs, decompression, record framing); a damaged file raises
    ``OSError`` or ``ValueError`` at the damage, never returns made-up events.
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self._reader = _native.FileReaderPy(str(self.path))
        #: The file header: run number, file sequence, codec, start time, configuration digest.
        self.header: Dict[str, Any] = dict(self._reader.header())
        self._metadata: Optional[Dict[str, Any]] = None
        self._started = False

    @property
    def metadata(self) -> Dict[str, Any]:
        """The JSON sidecar written when the file was finalised (counts, CRC, event-ID range,
        sources); empty if there is none."""
        if self._metadata is None:
            side = self.path.with_name(self.path.name + ".json")
            try:
                with builtins.open(side, "r", encoding="utf-8") as fh:
                    self._metadata = json.load(fh)
            except FileNotFoundError:
                self._metadata = {}
        return self._metadata

    @property
    def trailer(self) -> Optional[Dict[str, Any]]:
        """The trailer (counts and file CRC, with ``crc_ok``) once every event was read."""
        t = self._reader.trailer()
        return dict(t) if t is not None else None

    def __iter__(self) -> Iterator[Event]:
        if self._started:
            raise ValueError(f"{self.path}: a File is read once; open it again to re-read")
        self._started = True
        while True:
            block = self._reader.next_block()
            if block is None:
                return
            buf, events = block
            for t in events:
                yield Event(buf, t)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"tessera.File({str(self.path)!r}, run {self.header.get('run_number')})"


def files_of(path: PathLike, run: Optional[int] = None) -> List[Path]:
    """The finished ``.tsr`` files under a directory (or the file itself), in run and sequence
    order; ``run`` keeps one run's files."""
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(p.glob("*.tsr"))
    if run is not None:
        files = [f for f in files if f.name.startswith(f"run{run:06d}_")]
    return files


class Run:
    """Every file of a run (or of a directory), read one after the other."""

    def __init__(self, path: PathLike, run: Optional[int] = None):
        self.files = files_of(path, run)
        if not self.files:
            raise FileNotFoundError(f"no .tsr files under {path}")

    @property
    def metadata(self) -> List[Dict[str, Any]]:
        """Each file's sidecar."""
        out = []
        for f in self.files:
            with File(f) as fh:
                out.append(fh.metadata)
        return out

    def __iter__(self) -> Iterator[Event]:
        for f in self.files:
            with File(f) as fh:
                yield from fh

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def open(path: PathLike) -> File:  # noqa: A001 - the package's entry point, like builtins.open
    """Opens one recorded file: ``with tessera.open(path) as f: for event in f: ...``."""
    return File(path)


def open_run(path: PathLike, run: Optional[int] = None) -> Run:
    """Opens every file of a directory (optionally of one run) as one stream of events."""
    return Run(path, run)
