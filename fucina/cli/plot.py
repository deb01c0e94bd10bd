"""PNG pictures without a plotting library: an RGB PNG writer and loss curves.

    png = loss_curves_png([("train", [(1, 2.31), (2, 2.05), ...], (31, 119, 180)),
                           ("eval", [(0, 2.40), (10, 1.90)], (255, 127, 14))])

The project keeps its dependencies few, so the demos draw with numpy (the I/O bridge) and write
the PNG themselves: `png_bytes` stores 8-bit RGB rows unfiltered in one zlib stream, which
every reader accepts. Tick labels and the legend use a 5x7 pixel font drawn here.
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from ..errors import InvalidArgument

__all__ = ["png_bytes", "loss_curves_png", "draw_text"]


def png_bytes(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG (filter 0 on every row, one zlib IDAT)."""
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3
            and rgb.shape[2] == 3 and rgb.shape[0] > 0 and rgb.shape[1] > 0):
        raise InvalidArgument(f"png_bytes: rgb: expected a uint8 array [height, width, 3], got "
                              f"{getattr(rgb, 'dtype', type(rgb).__name__)} "
                              f"{getattr(rgb, 'shape', '')}")
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (struct.pack(">I", len(payload)) + kind + payload
                + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# 5x7 glyphs, seven rows of five pixels ("#" set) per character
_GLYPHS = {
    "0": [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    "1": ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "2": [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    "3": ["####.", "....#", "....#", ".###.", "....#", "....#", "####."],
    "4": ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    "5": ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    "6": ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "8": [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
    ".": [".....", ".....", ".....", ".....", ".....", ".##..", ".##.."],
    "-": [".....", ".....", ".....", "#####", ".....", ".....", "....."],
    "a": [".....", ".....", ".###.", "....#", ".####", "#...#", ".####"],
    "e": [".....", ".....", ".###.", "#...#", "#####", "#....", ".###."],
    "i": ["..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."],
    "l": [".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "n": [".....", ".....", "####.", "#...#", "#...#", "#...#", "#...#"],
    "o": [".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."],
    "p": [".....", ".....", "####.", "#...#", "####.", "#....", "#...."],
    "r": [".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."],
    "s": [".....", ".....", ".####", "#....", ".###.", "....#", "####."],
    "t": [".#...", ".#...", "####.", ".#...", ".#...", ".#..#", "..##."],
    "v": [".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."],
    " ": [".....", ".....", ".....", ".....", ".....", ".....", "....."],
}
_GLYPHS = {c: np.array([[ch == "#" for ch in row] for row in g], bool)
           for c, g in _GLYPHS.items()}


def draw_text(img: np.ndarray, x: int, y: int, text: str, color, scale: int = 1) -> int:
    """Draw `text` with its top-left corner at (x, y); returns the x after it. Characters
    without a glyph are drawn as spaces."""
    h, w, _ = img.shape
    for ch in text:
        glyph = np.kron(_GLYPHS.get(ch, _GLYPHS[" "]), np.ones((scale, scale), bool))
        gh, gw = glyph.shape
        y0, y1, x0, x1 = max(y, 0), min(y + gh, h), max(x, 0), min(x + gw, w)
        if y0 < y1 and x0 < x1:
            img[y0:y1, x0:x1][glyph[y0 - y:y1 - y, x0 - x:x1 - x]] = color
        x += gw + scale
    return x


def _line(img, x0, y0, x1, y1, color, width=2):
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    h, w, _ = img.shape
    for dy in range(width):
        for dx in range(width):
            xx, yy = np.clip(xs + dx - width // 2, 0, w - 1), np.clip(ys + dy - width // 2, 0, h - 1)
            img[yy, xx] = color


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{v:.{digits}f}"


def loss_curves_png(series, width: int = 640, height: int = 400, title: str = "loss") -> bytes:
    """Curves of (x, y) points on shared axes, one colour each, with tick labels and a legend.
    `series` is a list of (name, [(x, y), ...], (r, g, b)); non-finite y values are skipped."""
    pts = [(x, y) for _, p, _ in series for x, y in p if math.isfinite(y)]
    if not pts:
        raise InvalidArgument("loss_curves_png: series: expected at least one finite point")
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 56, 16, 28, 30
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    y_lo, y_hi = min(ys), max(ys)
    pad = (y_hi - y_lo) * 0.05 or abs(y_hi) * 0.05 or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad
    pw, ph = width - left - right, height - top - bottom

    def px(x):
        return left + (x - x_lo) / (x_hi - x_lo) * (pw - 1)

    def py(y):
        return top + (y_hi - y) / (y_hi - y_lo) * (ph - 1)

    grid, axis, ink = (232, 232, 232), (120, 120, 120), (40, 40, 40)
    yt = _nice_ticks(y_lo, y_hi)
    for v in yt:
        r = int(round(py(v)))
        img[r, left:left + pw] = grid
        lab = _label(v, yt[1] - yt[0] if len(yt) > 1 else 1.0)
        draw_text(img, left - 6 - 6 * len(lab), r - 3, lab, ink)
    xt = [v for v in _nice_ticks(x_lo, x_hi, 6) if v == int(v)] or [x_lo, x_hi]
    for v in xt:
        c = int(round(px(v)))
        img[top:top + ph, c] = grid
        lab = str(int(v))
        draw_text(img, c - 3 * len(lab), top + ph + 6, lab, ink)
    img[top:top + ph, left] = axis
    img[top:top + ph, left + pw - 1] = axis
    img[top, left:left + pw] = axis
    img[top + ph - 1, left:left + pw] = axis
    draw_text(img, left, 8, title, ink, scale=2)
    draw_text(img, left + pw - 24, top + ph + 18, "step", ink)
    for name, points, color in series:
        fin = [(x, y) for x, y in points if math.isfinite(y)]
        for (xa, ya), (xb, yb) in zip(fin, fin[1:]):
            _line(img, px(xa), py(ya), px(xb), py(yb), color)
        if len(fin) <= 30:   # sparse series (eval, short runs) get point markers
            for x, y in fin:
                c, r = int(round(px(x))), int(round(py(y)))
                img[max(r - 2, 0):r + 3, max(c - 2, 0):c + 3] = color
    lx, ly = left + pw - 110, top + 8
    for name, _, color in series:
        img[ly + 2:ly + 10, lx:lx + 16] = color
        draw_text(img, lx + 22, ly, name, ink, scale=2)
        ly += 20
    return png_bytes(img)
