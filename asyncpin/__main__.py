"""``python -m asyncpin``: the command line (see :mod:`asyncpin.cli`)."""

from __future__ import annotations

import warnings

# torch without NumPy warns on import; asyncpin needs no NumPy, and the command line
# promises one line on stderr for an error.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

try:
    from asyncpin.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing: nothing is open yet
    raise SystemExit(130) from None

raise SystemExit(main())
