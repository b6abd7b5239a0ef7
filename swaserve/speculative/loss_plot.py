"""A loss curve as a PNG with no plotting library: axes, light grid lines at the y ticks, the
curve as a polyline (training in blue, held-out points in orange, joined); the axis ranges go
in the PNG's text chunks (the CSV holds the numbers)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 640, 360, 40
WHITE, GREY, BLACK, BLUE = (255, 255, 255), (225, 225, 225), (0, 0, 0), (31, 119, 180)
ORANGE = (255, 127, 14)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(pixels: list[bytearray], text: dict[str, str]) -> bytes:
    """RGB rows (each WIDTH * 3 bytes) -> PNG bytes."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    head = struct.pack(">IIBBBBB", len(pixels[0]) // 3, len(pixels), 8, 2, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", head)
    for key, value in text.items():
        out += _chunk(b"tEXt", key.encode("latin-1") + b"\x00" + value.encode("latin-1"))
    return out + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def _line(img: list[bytearray], x0: int, y0: int, x1: int, y1: int, rgb: tuple) -> None:
    """Bresenham, clipped to the image."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        if 0 <= x0 < WIDTH and 0 <= y0 < HEIGHT:
            img[y0][3 * x0 : 3 * x0 + 3] = bytes(rgb)
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


def plot_loss(
    values: list[float],
    path: str | Path,
    title: str = "loss",
    heldout: list[tuple[int, float]] | None = None,
) -> None:
    """Write the curve of `values` (one per step) to `path`, and the held-out (index into
    `values`, loss) points, if any, on the same axes."""
    img = [bytearray(WHITE * WIDTH) for _ in range(HEIGHT)]
    heldout = heldout or []
    # the y range leaves out the first 1% of steps: the loss of an untrained drafter is many
    # times its later values and would flatten the rest of the curve (its start is clipped)
    every = list(values[len(values) // 100 :]) + [v for _, v in heldout]
    lo, hi = (min(every), max(every)) if every else (0.0, 1.0)
    if hi - lo < 1e-12:
        hi = lo + 1.0
    x_span, y_span = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN
    for i in range(5):  # grid at the y ticks
        y = MARGIN + round(i * y_span / 4)
        _line(img, MARGIN, y, WIDTH - MARGIN, y, GREY)
    _line(img, MARGIN, MARGIN, MARGIN, HEIGHT - MARGIN, BLACK)
    _line(img, MARGIN, HEIGHT - MARGIN, WIDTH - MARGIN, HEIGHT - MARGIN, BLACK)
    n = max(1, len(values) - 1, *(i for i, _ in heldout))

    def point(i: float, v: float) -> tuple[int, int]:
        y = HEIGHT - MARGIN - round((v - lo) / (hi - lo) * y_span)
        return MARGIN + round(i * x_span / n), y

    for series, rgb in ((list(enumerate(values)), BLUE), (heldout, ORANGE)):
        pts = [point(i, v) for i, v in series]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            _line(img, x0, y0, x1, y1, rgb)
        for x, y in pts if rgb == ORANGE else []:  # a small cross at each held-out point
            _line(img, x - 2, y, x + 2, y, rgb)
            _line(img, x, y - 2, x, y + 2, rgb)
    text = {"Title": title, "Comment": f"steps 0..{len(values) - 1}, y {lo:.4g}..{hi:.4g} "
            "(the first 1% of steps may lie above it)"
            + (" (orange: held-out)" if heldout else "")}
    Path(path).write_bytes(encode_png(img, text))
