"""Figures the benchmarks commit, saved as 256-colour PNGs.

A line plot has a few dozen colours plus its anti-aliasing shades; in a 256-colour palette it looks the same and
takes about a third of matplotlib's RGBA file, which keeps the curated results folders small.
"""

from __future__ import annotations

import io

PALETTE_COLOURS = 256


def write_figure(fig, path: str, dpi: int = 110) -> str:
    """fig laid out, saved to path (save_png) and closed; returns path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    save_png(fig, path, dpi)
    plt.close(fig)
    return path


def save_png(fig, path: str, dpi: int) -> None:
    """fig (a matplotlib figure) rendered at dpi and written to path as a 256-colour palette PNG."""
    from PIL import Image  # matplotlib's own dependency

    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=dpi)
    rendered.seek(0)
    with Image.open(rendered) as image:
        palette_png(image).save(path, optimize=True)


def palette_png(image):
    """image (Pillow) as a palette image of at most PALETTE_COLOURS colours, undithered: flat areas stay flat."""
    from PIL import Image

    return image.convert("RGB").quantize(PALETTE_COLOURS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
