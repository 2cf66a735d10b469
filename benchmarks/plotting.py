"""The benchmarks' one way to draw: matplotlib's pyplot on its file-only backend, or None (and a
line saying so) where matplotlib is not installed, so that a benchmark still writes its JSON."""
from __future__ import annotations


def pyplot():
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt
