"""bench/remote.py with other pipeline sizes: the blocks a fetch's pipeline reads
(``RemoteLink.batch``, 16), a write's pipeline sends (``write_batch``: 16 direct, 4
copying) and the parts a direct fetch reads at once (``read_depth``), for A/B runs of
one tree.

    python3 bench/probes/remote_batches.py --fetch-batch 64 -- --kind node --json-out x.json
    python3 bench/probes/remote_batches.py --read-depth 1 --script llama_ttft.py -- --redis-url ...
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

import asyncpin.tier.remote as remote  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fetch-batch", type=int, default=None)
    p.add_argument("--write-batch", type=int, default=None)
    p.add_argument("--read-depth", type=int, default=None)
    p.add_argument("--script", default="remote.py", help="the bench/ script run (remote.py)")
    args, rest = p.parse_known_args()
    init = remote.RemoteLink.__init__

    def patched(self: Any, *a: Any, **k: Any) -> None:
        if args.fetch_batch is not None:
            k["batch_blocks"] = args.fetch_batch
        if args.write_batch is not None:
            k["write_batch_blocks"] = args.write_batch
        if args.read_depth is not None:
            k["read_depth"] = args.read_depth
        init(self, *a, **k)

    remote.RemoteLink.__init__ = patched  # type: ignore[method-assign]
    sys.argv = [str(ROOT / "bench" / args.script), *[a for a in rest if a != "--"]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
