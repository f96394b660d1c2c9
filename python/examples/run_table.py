#!/usr/bin/env python3
"""Reads a run's files into a table of event ID, trigger type, size and flags.

    python examples/run_table.py data                 # every run under ./data
    python examples/run_table.py data --run 3 --csv events.csv

The table is a dict of numpy columns; with pandas installed it becomes a DataFrame
(`pandas.DataFrame(table)`), and `--csv` writes it out.
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional

import numpy as np

import tessera


def event_table(path: str, run: Optional[int] = None) -> Dict[str, np.ndarray]:
    """One row per event: the columns pandas.DataFrame takes as they are."""
    cols: Dict[str, list] = {k: [] for k in
                             ("event_id", "trigger_type", "size", "fragments", "flags",
                              "incomplete", "missing", "file")}
    for f in tessera.files_of(path, run):
        with tessera.open(f) as fh:
            for e in fh:
                cols["event_id"].append(e.event_id)
                cols["trigger_type"].append(e.trigger_type)
                cols["size"].append(e.size)
                cols["fragments"].append(e.fragment_count)
                cols["flags"].append(e.flags)
                cols["incomplete"].append(e.incomplete)
                cols["missing"].append(len(e.missing))
                cols["file"].append(f.name)
    types = {"event_id": np.uint64, "trigger_type": np.uint16, "size": np.uint32,
             "fragments": np.uint32, "flags": np.uint32, "incomplete": bool,
             "missing": np.uint32, "file": object}
    return {k: np.asarray(v, dtype=types[k]) for k, v in cols.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a .tsr file or a directory of them")
    ap.add_argument("--run", type=int)
    ap.add_argument("--csv")
    args = ap.parse_args()
    table = event_table(args.path, args.run)
    n = len(table["event_id"])
    try:
        import pandas as pd
    except ImportError:
        pd = None
    if pd is not None:
        df = pd.DataFrame(table)
        print(df.describe(include="all").to_string())
        if args.csv:
            df.to_csv(args.csv, index=False)
    else:
        print(f"{n} events (install pandas for a DataFrame)")
        if n:
            print(f"  event IDs {table['event_id'].min()} .. {table['event_id'].max()}, "
                  f"mean size {table['size'].mean():.0f} B, "
                  f"incomplete {int(table['incomplete'].sum())}")
        if args.csv:
            import csv
            with open(args.csv, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(table.keys())
                w.writerows(zip(*table.values()))
    print(f"{n} events; trigger types: "
          + ", ".join(f"{t}: {c}" for t, c in zip(*np.unique(table["trigger_type"], return_counts=True))))


if __name__ == "__main__":
    main()
