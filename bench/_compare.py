"""Gather a before/after pass into one JSON and print the table (``bench/gpu_pass.sh``).

    python3 -m bench._compare RUNS_DIR OUT_JSON

``RUNS_DIR`` holds ``{pinning,transfers}-{before,after}-{repeat}.json`` as the bench
scripts wrote them. Each figure is the median over repeats; the ratio is after / before.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

# (label, script, path in the script's JSON, unit)
FIGURES: list[tuple[str, str, tuple[str, ...], str]] = [
    ("pinning 16 GiB: time to pinned", "pinning", ("sizes", "16GiB", "asyncpin", "pinned_s"), "s"),
    ("pinning 16 GiB", "pinning", ("sizes", "16GiB", "asyncpin", "gib_per_s"), "GiB/s"),
    ("pinning 16 GiB: loop lag, max", "pinning", ("sizes", "16GiB", "asyncpin", "lag_s"), "s"),
]
for _size in ("32MiB", "256MiB"):
    for _key in ("store", "load", "both"):
        FIGURES.append(
            (f"{_size} {_key}", "transfers", ("transfers", "sizes", _size, f"{_key}_gbps"), "GB/s")
        )
        FIGURES.append(
            (
                f"{_size} {_key}, contiguous peer",
                "transfers",
                ("transfers", "sizes", _size, f"contiguous_{_key}_gbps"),
                "GB/s",
            )
        )
FIGURES += [
    ("await one block p50", "transfers", ("await", "p50_us"), "us"),
    ("await one block p99", "transfers", ("await", "p99_us"), "us"),
    ("await peer to_thread p50", "transfers", ("await", "peer_p50_us"), "us"),
]


def _dig(doc: Any, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return float(doc) if isinstance(doc, int | float) else None


def main(runs_dir: Path, out: Path) -> int:
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(runs_dir.glob("*.json")):
        script, side, _ = path.stem.split("-", 2)
        runs.setdefault(f"{script}-{side}", []).append(json.loads(path.read_text()))
    rows = []
    for label, script, keys, unit in FIGURES:
        row: dict[str, Any] = {"figure": label, "unit": unit}
        for side in ("before", "after"):
            values = [
                v for d in runs.get(f"{script}-{side}", []) if (v := _dig(d, keys)) is not None
            ]
            row[side] = statistics.median(values) if values else None
            row[f"{side}_all"] = values
        row["after_over_before"] = (
            row["after"] / row["before"] if row["before"] and row["after"] is not None else None
        )
        rows.append(row)
    out.write_text(json.dumps({"figures": rows, "runs": runs}, indent=1) + "\n")
    print(f"\n{'figure':<40} {'unit':>6} {'before':>9} {'after':>9} {'after/before':>12}  n")
    for r in rows:

        def cell(v: float | None) -> str:
            return "-" if v is None else f"{v:.3g}" if v < 10 else f"{v:.1f}"

        ratio = "-" if r["after_over_before"] is None else f"{r['after_over_before']:.3f}"
        print(
            f"{r['figure']:<40} {r['unit']:>6} {cell(r['before']):>9} {cell(r['after']):>9} "
            f"{ratio:>12}  {len(r['before_all'])}/{len(r['after_all'])}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
