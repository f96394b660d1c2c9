#!/usr/bin/env python3
"""Keeps a live histogram of fragment sizes per source from a running Tessera.

Start the demo (`cargo run --release -- run` in the repository), then:

    python examples/live_histogram.py                # attaches to 127.0.0.1:7711, station "sample"
    python examples/live_histogram.py --plot         # the same in a matplotlib window

It attaches to a sampling station (it can never slow the run down), prints one text histogram
per source every few seconds, and reattaches by itself when the demo is restarted.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

import tessera


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", default="127.0.0.1:7711")
    ap.add_argument("--station", default="sample")
    ap.add_argument("--bins", type=int, default=12)
    ap.add_argument("--every", type=float, default=3.0, help="seconds between printouts")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: Ctrl-C)")
    ap.add_argument("--plot", action="store_true", help="draw with matplotlib")
    args = ap.parse_args()

    sizes: dict[int, list[int]] = defaultdict(list)
    events = 0
    t0 = last = time.time()
    plt = None
    if args.plot:
        import matplotlib.pyplot as plt  # optional dependency
        plt.ion()
    with tessera.attach(args.addr, args.station, name="live_histogram.py") as c:
        print(f"attached to {args.station} at {args.addr}")
        while not args.seconds or time.time() - t0 < args.seconds:
            batch = c.get(200, timeout=1.0)
            for e in batch:
                events += 1
                for f in e.fragments:
                    sizes[f.source_id].append(f.size)
            c.put(batch)
            if time.time() - last >= args.every and sizes:
                last = time.time()
                show(sizes, events, args.bins, c.restarts, plt)
    if sizes:
        show(sizes, events, args.bins, 0, plt)


def show(sizes, events, bins, restarts, plt) -> None:
    allv = np.concatenate([np.asarray(v) for v in sizes.values()])
    edges = np.linspace(allv.min(), allv.max() + 1, bins + 1)
    print(f"\n{events} events sampled" + (f" ({restarts} restarts seen)" if restarts else ""))
    for src in sorted(sizes):
        h, _ = np.histogram(sizes[src], edges)
        bar = "".join(" ▁▂▃▄▅▆▇█"[min(8, int(8 * x / max(1, h.max())))] for x in h)
        print(f"  source {src:>4}: {bar}  mean {np.mean(sizes[src]):8.0f} B  n={len(sizes[src])}")
    print(f"  bins {edges[0]:.0f} .. {edges[-1]:.0f} bytes")
    if plt is not None:
        plt.clf()
        for src in sorted(sizes):
            plt.hist(sizes[src], edges, histtype="step", label=f"source {src}")
        plt.xlabel("fragment payload size (bytes)")
        plt.legend()
        plt.pause(0.01)


if __name__ == "__main__":
    main()
