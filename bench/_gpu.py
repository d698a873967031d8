"""What a bench script that measures a CUDA GPU does first."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def require_gpu() -> None:
    """Exit with a one-line message and status 1 when no CUDA GPU is visible."""
    if torch.cuda.is_available():
        return
    why = (
        f"torch {torch.__version__} is built without CUDA"
        if torch.version.cuda is None
        else "none is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    )
    sys.exit(f"{Path(sys.argv[0]).name} needs a CUDA GPU: {why}")
