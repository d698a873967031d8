"""``python -m asyncpin``: the command line (see :mod:`asyncpin.cli`)."""

from __future__ import annotations

try:
    from asyncpin.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing: nothing is open yet
    raise SystemExit(130) from None

raise SystemExit(main())
