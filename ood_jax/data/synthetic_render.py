"""Procedural stand-in for COUNTS: the ``synthetic`` (synthetic_shifts) detection dataset.

Renders a small, fully synthetic detection dataset in COUNTS' 14 domains, so that a DETR-style
detector trains on a few domains on CPU in minutes and still shows a real in-domain vs.
held-out gap. It is *always* synthetic: nothing here comes from, or claims to look like, the
real COUNTS images. Rendering is vectorized numpy, a pure function of the generator's state
(docs/guide/datasets.md#the-synthetic-set).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np

from ood_jax.data import counts

__all__ = [
    "CLASS_NAMES",
    "DOMAINS",
    "image_id",
    "render_example",
    "render_split",
    "split_example",
]

CLASS_NAMES: tuple[str, ...] = (
    "circle",  # glossy solid red disc
    "square",  # blue/white horizontal stripes
    "triangle",  # orange with dark dots
    "cross",  # black/white checker plus-sign
    "ring",  # purple annulus with a light middle band
    "star",  # yellow five-pointed star, pale radial centre
    "diamond",  # cyan/teal diagonal stripes, tall rhombus
    "bar",  # magenta capsule with wavy cross bands
)

# The 14 COUNTS domains, in the paper's order.
DOMAINS: tuple[str, ...] = counts.DOMAINS

_DOMAIN_INDEX = {d: i for i, d in enumerate(DOMAINS)}
_TAU = np.float32(2.0 * np.pi)
_F = np.float32

# Canonical colour families: (primary, secondary) RGB in [0, 1].
_CLASS_COLORS = (
    ((0.86, 0.14, 0.12), (0.45, 0.03, 0.03)),  # circle
    ((0.12, 0.30, 0.88), (0.93, 0.95, 0.99)),  # square
    ((0.98, 0.58, 0.06), (0.28, 0.10, 0.02)),  # triangle
    ((0.07, 0.07, 0.08), (0.96, 0.96, 0.96)),  # cross
    ((0.52, 0.16, 0.74), (0.88, 0.74, 0.98)),  # ring
    ((1.00, 0.86, 0.08), (1.00, 1.00, 0.78)),  # star
    ((0.05, 0.80, 0.84), (0.02, 0.30, 0.36)),  # diamond
    ((0.93, 0.22, 0.62), (1.00, 0.82, 0.92)),  # bar
)
# Rotation jitter (radians, +-), aspect jitter, size multiplier per class.
_CLASS_ROT = (0.0, 0.35, 0.26, 0.35, np.pi, 0.35, 0.2, np.pi)
_CLASS_ASPECT = (0.08, 0.12, 0.12, 0.1, 0.08, 0.1, 0.1, 0.1)
_CLASS_SCALE = (1.0, 1.0, 1.05, 1.05, 1.0, 1.1, 1.05, 1.3)


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #
class _Ctx:
    """Per-image state: rng, size and broadcastable pixel-centre coordinates."""

    __slots__ = ("S", "X", "Y", "extra", "rng")

    def __init__(self, rng: np.random.Generator, size: int):
        self.rng = rng
        self.S = size
        ar = np.arange(size, dtype=np.float32) + _F(0.5)
        self.Y = ar[:, None]
        self.X = ar[None, :]
        self.extra: dict = {}

    def u(self, lo=0.0, hi=1.0, n=None):
        return self.rng.uniform(lo, hi, n)


def _rgb(*c) -> np.ndarray:
    return np.asarray(c, dtype=np.float32)


def _lerp(a, b, t):
    return a + (b - a) * t


def _smoothstep(e0, e1, x):
    t = np.clip((x - e0) / (e1 - e0), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _jitter(c: _Ctx, col, amt=0.1, add=0.03) -> np.ndarray:
    col = np.asarray(col, np.float32)
    out = col * c.rng.uniform(1 - amt, 1 + amt, 3) + c.rng.uniform(-add, add, 3)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def _lattice(grid: np.ndarray, fy, fx) -> np.ndarray:
    """Smooth bilinear value-noise lookup (wrapping) at float lattice coords."""
    gh, gw = grid.shape
    fy0 = np.floor(fy)
    fx0 = np.floor(fx)
    ty = fy - fy0
    tx = fx - fx0
    ty = ty * ty * (3.0 - 2.0 * ty)
    tx = tx * tx * (3.0 - 2.0 * tx)
    iy0 = fy0.astype(np.intp) % gh
    ix0 = fx0.astype(np.intp) % gw
    iy1 = (iy0 + 1) % gh
    ix1 = (ix0 + 1) % gw
    a = grid[iy0, ix0]
    b = grid[iy0, ix1]
    cc = grid[iy1, ix0]
    d = grid[iy1, ix1]
    top = a + (b - a) * tx
    bot = cc + (d - cc) * tx
    return (top + (bot - top) * ty).astype(np.float32)


def _lerp_axis(grid: np.ndarray, f: np.ndarray, axis: int) -> np.ndarray:
    """Smooth 1-D interpolation of ``grid`` along ``axis`` at lattice coords ``f`` (wrapping)."""
    n = grid.shape[axis]
    f0 = np.floor(f)
    t = f - f0
    t = t * t * (3.0 - 2.0 * t)
    i0 = f0.astype(np.intp) % n
    i1 = (i0 + 1) % n
    a = np.take(grid, i0, axis=axis)
    b = np.take(grid, i1, axis=axis)
    t = t[:, None] if axis == 0 else t[None, :]
    return a + (b - a) * t


def _noise(c: _Ctx, cy: float, cx: float | None = None, fy=None, fx=None) -> np.ndarray:
    """Value noise in [0, 1] with about ``cy x cx`` cells across the image."""
    cx = cy if cx is None else cx
    if fy is None:
        fy, fx = c.Y, c.X
    gh = int(np.ceil(cy)) + 3
    gw = int(np.ceil(cx)) + 3
    grid = c.rng.random((gh, gw), dtype=np.float32)
    oy, ox = c.rng.random(2) * 2.0
    ly = fy * _F(cy / c.S) + _F(oy)
    lx = fx * _F(cx / c.S) + _F(ox)
    if ly.ndim == 2 and lx.ndim == 2 and ly.shape[1] == 1 and lx.shape[0] == 1:
        # axis-aligned lattice: separable interpolation as two small matmuls
        # (no BLAS: thread start-up costs more than the work at these sizes)
        return _lerp_axis(_lerp_axis(grid, ly[:, 0], 0), lx[0], 1)
    return _lattice(grid, ly, lx)


def _fbm(c: _Ctx, cells: float, octaves: int = 3, aniso=(1.0, 1.0), fy=None, fx=None):
    total = None
    amp, norm = 1.0, 0.0
    for o in range(octaves):
        f = cells * (2**o)
        n = _noise(c, f * aniso[0], f * aniso[1], fy, fx)
        total = n * _F(amp) if total is None else total + n * _F(amp)
        norm += amp
        amp *= 0.5
    return total / _F(norm)


def _white(c: _Ctx, shape=None) -> np.ndarray:
    shape = (c.S, c.S) if shape is None else shape
    return c.rng.standard_normal(shape, dtype=np.float32)


def _paint(img, mask, col):
    """Paint constant colour (or per-pixel colour image) where mask is True."""
    np.copyto(img, col, where=mask[..., None])


def _vgrad(c: _Ctx, top, bottom, y0=0.0, y1=None):
    y1 = c.S if y1 is None else y1
    t = np.clip((c.Y - y0) / max(y1 - y0, 1.0), 0.0, 1.0)[..., None]  # (S,1,1)
    return np.broadcast_to(_lerp(_rgb(*top), _rgb(*bottom), t), (c.S, c.S, 3)).astype(np.float32)


# --------------------------------------------------------------------------- #
# Object shapes (signed distance in normalised units, negative inside)
# --------------------------------------------------------------------------- #
def _sd_box(u, v, bx, by):
    qx = np.abs(u) - bx
    qy = np.abs(v) - by
    out = np.sqrt(np.maximum(qx, 0.0) ** 2 + np.maximum(qy, 0.0) ** 2)
    return out + np.minimum(np.maximum(qx, qy), 0.0)


def _convex(verts):
    verts = np.asarray(verts, np.float32)
    cen = verts.mean(0)
    planes = []
    for i in range(len(verts)):
        p0, p1 = verts[i], verts[(i + 1) % len(verts)]
        e = p1 - p0
        n = np.array([e[1], -e[0]], np.float32)
        n /= np.linalg.norm(n)
        if np.dot(n, cen - p0) > 0:
            n = -n
        planes.append((float(n[0]), float(n[1]), float(np.dot(n, p0))))
    return tuple(planes)


_TRI = _convex([(0.0, -1.0), (0.97, 0.72), (-0.97, 0.72)])
_DIA = _convex([(0.0, -1.0), (0.64, 0.0), (0.0, 1.0), (-0.64, 0.0)])


def _sd_convex(u, v, planes):
    d = None
    for nx, ny, off in planes:
        di = u * _F(nx) + v * _F(ny) - _F(off)
        d = di if d is None else np.maximum(d, di)
    return d


def _sd_star5(u, v, rf=0.48):
    """Five-pointed star (I. Quilez's exact SDF), one point up."""
    k1x, k1y = 0.809016994375, -0.587785252292
    k2x, k2y = -k1x, k1y
    px = np.abs(u)
    py = -v
    m = 2.0 * np.maximum(k1x * px + k1y * py, 0.0)
    px, py = px - m * k1x, py - m * k1y
    m = 2.0 * np.maximum(k2x * px + k2y * py, 0.0)
    px, py = px - m * k2x, py - m * k2y
    px = np.abs(px)
    py = py - 1.0
    bax, bay = rf * -k1y, rf * k1x - 1.0
    h = np.clip((px * bax + py * bay) / (bax * bax + bay * bay), 0.0, 1.0)
    dx, dy = px - bax * h, py - bay * h
    return np.sqrt(dx * dx + dy * dy) * np.sign(py * bax - px * bay)


def _sdf(cls: int, u, v):
    if cls == 0:
        return np.sqrt(u * u + v * v) - 1.0
    if cls == 1:
        return _sd_box(u, v, 0.72, 0.72) - 0.1
    if cls == 2:
        return _sd_convex(u, v, _TRI)
    if cls == 3:
        return np.minimum(_sd_box(u, v, 1.0, 0.32), _sd_box(u, v, 0.32, 1.0))
    if cls == 4:
        return np.abs(np.sqrt(u * u + v * v) - 0.72) - 0.28
    if cls == 5:
        return _sd_star5(u, v)
    if cls == 6:
        return _sd_convex(u, v, _DIA)
    if cls == 7:
        return _sd_box(u, v, 0.78, 0.12) - 0.2
    raise ValueError(cls)


def _texture(cls: int, u, v, prim, sec, ph):
    """Canonical per-class texture in object-local coordinates -> (h, w, 3)."""
    if cls == 0:  # glossy solid
        shade = 1.08 - 0.28 * (u * u + v * v) - 0.12 * (u + v)
        col = prim * shade[..., None]
        spot = np.exp(-((u + 0.38) ** 2 + (v + 0.38) ** 2) / 0.05)
        return col + (1.0 - col) * (0.7 * spot)[..., None]
    if cls == 1:  # horizontal stripes
        t = np.sin(_TAU * 1.55 * v + ph) > 0
    elif cls == 2:  # dots
        fu = (u / 0.5 + ph) % 1.0 - 0.5
        fv = (v / 0.5 + ph * 0.7) % 1.0 - 0.5
        t = fu * fu + fv * fv < 0.09
    elif cls == 3:  # checker aligned with the arms
        t = ((np.floor((u + 0.32) / 0.32) + np.floor((v + 0.32) / 0.32)) % 2) > 0
    elif cls == 4:  # light middle band
        rho = np.sqrt(u * u + v * v)
        t = np.abs(rho - 0.72) < 0.085
    elif cls == 5:  # radial gradient
        rho = np.sqrt(u * u + v * v)
        t = np.clip(1.0 - rho * 1.5, 0.0, 1.0)[..., None]
        return prim + (sec - prim) * t
    elif cls == 6:  # diagonal stripes
        t = np.sin(_TAU * 1.3 * (u + v) + ph) > 0
    else:  # bar: wavy cross bands
        t = np.sin(_TAU * (1.9 * u + 0.15 * np.sin(_TAU * 1.6 * v)) + ph) > 0
    return np.where(t[..., None], sec, prim)


# --------------------------------------------------------------------------- #
# Object sampling and drawing
# --------------------------------------------------------------------------- #
def _sample_objects(c: _Ctx, n: int, r_range, y_range=(0.0, 1.0)):
    S, rng = c.S, c.rng
    objs = []
    lo, hi = np.log(r_range[0] * S), np.log(r_range[1] * S)
    for _ in range(n):
        cls = int(rng.integers(len(CLASS_NAMES)))
        for _try in range(25):
            r = float(np.exp(rng.uniform(lo, hi))) * _CLASS_SCALE[cls]
            r = max(r, 4.0)
            asp = _CLASS_ASPECT[cls]
            ax, ay = rng.uniform(1 - asp, 1 + asp, 2)
            R = r * max(ax, ay)
            ymin = max(0.6 * R, y_range[0] * S)
            ymax = min(S - 0.6 * R, y_range[1] * S)
            if ymax <= ymin:
                ymin, ymax = 0.6 * R, S - 0.6 * R
            cx = rng.uniform(0.6 * R, S - 0.6 * R)
            cy = rng.uniform(ymin, ymax)
            ok = True
            for o in objs:
                dist = np.hypot(cx - o["cx"], cy - o["cy"])
                if dist < R + o["R"] - 0.35 * min(R, o["R"]):
                    ok = False
                    break
            if ok:
                break
        else:
            continue
        prim, sec = _CLASS_COLORS[cls]
        objs.append(
            {
                "cls": cls,
                "cx": cx,
                "cy": cy,
                "r": r,
                "R": R,
                "ax": ax,
                "ay": ay,
                "theta": float(rng.uniform(-_CLASS_ROT[cls], _CLASS_ROT[cls])),
                "prim": _jitter(c, prim, 0.12, 0.04),
                "sec": _jitter(c, sec, 0.08, 0.04),
                "ph": float(rng.uniform(0, 2 * np.pi)),
                "wob": rng.uniform(0, 2 * np.pi, 3),
            }
        )
    return objs


def _draw_object(c: _Ctx, canvas, idmap, full, k: int, o: dict, style: str):
    """Composite object ``k`` onto canvas; records its full mask in ``full[k]``."""
    S = c.S
    handmade = style == "handmade"
    ext = o["R"] * (1.3 if handmade else 1.15) + 2.0
    x0, x1 = max(0, int(o["cx"] - ext)), min(S, int(np.ceil(o["cx"] + ext)) + 1)
    y0, y1 = max(0, int(o["cy"] - ext)), min(S, int(np.ceil(o["cy"] + ext)) + 1)
    if x1 <= x0 or y1 <= y0:
        return
    dx = c.X[:, x0:x1] - _F(o["cx"])
    dy = c.Y[y0:y1, :] - _F(o["cy"])
    ct, st = np.cos(o["theta"]), np.sin(o["theta"])
    r = o["r"]
    u = (ct * dx + st * dy) / _F(r * o["ax"])
    v = (-st * dx + ct * dy) / _F(r * o["ay"])
    d = _sdf(o["cls"], u, v)
    if handmade:  # wobbly hand-drawn outline
        phi = np.arctan2(v, u)
        w = o["wob"]
        d = d + 0.045 * (
            np.sin(3 * phi + w[0]) + 0.7 * np.sin(5 * phi + w[1]) + 0.5 * np.sin(9 * phi + w[2])
        )
    dpx = d * _F(r)
    mask = dpx < 0.5
    if not mask.any():
        return
    alpha = np.clip(0.5 - dpx, 0.0, 1.0)[..., None]
    col = _texture(o["cls"], u, v, o["prim"], o["sec"], o["ph"]).astype(np.float32)
    under = canvas[y0:y1, x0:x1]
    if handmade:
        # crayon hatching: strokes of colour with paper showing through
        a = o["wob"][0]
        s = (dx * np.cos(a) + dy * np.sin(a)) / _F(3.2)
        grain = c.rng.random(dpx.shape, dtype=np.float32)
        fill = np.where((s % 1.0) < 0.62, 0.92, 0.3) * (0.75 + 0.25 * grain)
        col = _lerp(under, np.clip(col * 1.05 + 0.05, 0, 1), fill[..., None])
        edge = (dpx > -2.2)[..., None]
        col = np.where(edge, o["prim"] * 0.3 * (0.8 + 0.4 * grain[..., None]), col)
    else:
        edge = (dpx > -1.0)[..., None]
        col = np.where(edge, col * 0.5, col)
        if style == "sky":  # far away: atmospheric haze
            col = _lerp(col, c.extra["haze"], _F(c.extra["haze_amt"]))
        elif style == "water":  # partly submerged: blue cast + caustics
            caus = 0.88 + 0.24 * np.sin(_TAU * (dx * 0.19 + 0.6 * np.sin(dy * 0.31)))
            col = _lerp(col, c.extra["water"], _F(0.22)) * caus[..., None]
    canvas[y0:y1, x0:x1] = under * (1.0 - alpha) + col * alpha
    idmap[y0:y1, x0:x1][mask] = k + 1
    full[k, y0:y1, x0:x1] = mask


def _try_occluder(canvas, idmap, full, occ, col, max_cover: float) -> bool:
    """Paint occluder ``occ`` if every object keeps >= (1 - max_cover) visible."""
    n = full.shape[0]
    if not occ.any():
        return False
    vis = np.bincount(idmap.ravel(), minlength=n + 1)[1:]
    removed = np.bincount(idmap[occ], minlength=n + 1)[1:]
    tot = full.reshape(n, -1).sum(1)
    if np.any((vis - removed) < (1.0 - max_cover) * tot):
        return False
    _paint(canvas, occ, col)
    idmap[occ] = 0
    return True


# --------------------------------------------------------------------------- #
# Backgrounds
# --------------------------------------------------------------------------- #
def _bg_generic(c: _Ctx):
    g = c.u(0.35, 0.62)
    a = np.clip(g + c.u(-0.12, 0.12, 3), 0, 1)
    b = np.clip(g * c.u(0.7, 1.2) + c.u(-0.12, 0.12, 3), 0, 1)
    t = _smoothstep(0.3, 0.7, _fbm(c, 2.5, 3))[..., None]
    img = _lerp(_rgb(*a), _rgb(*b), t)
    img = img * (0.9 + 0.2 * _fbm(c, 12, 2))[..., None] * (1.1 - 0.2 * c.Y / c.S)[..., None]
    return img.astype(np.float32)


def _bg_dusk(c: _Ctx):
    S = c.S
    h = c.u(0.35, 0.6) * S
    img = _vgrad(c, (0.22, 0.18, 0.42), (0.98, 0.55, 0.28), 0, h).copy()
    hill = h - (0.05 + 0.12 * _noise(c, 1, 4, fy=np.zeros_like(c.X), fx=c.X)) * S
    ground = c.Y >= hill
    gcol = (
        _vgrad(c, (0.25, 0.2, 0.2), (0.12, 0.1, 0.1), h, S) * (0.8 + 0.4 * _fbm(c, 8, 2))[..., None]
    )
    _paint(img, ground, gcol)
    # a bright low sun behind the scene (backlighting)
    sx = c.u(0.2, 0.8) * S
    glow = np.exp(-(((c.X - sx) ** 2 + (c.Y - h) ** 2) / (0.05 * S * S)))[..., None]
    return (img + glow * _rgb(0.6, 0.4, 0.15)).astype(np.float32)


def _bg_painting(c: _Ctx):
    S = c.S
    h = c.u(0.3, 0.6) * S
    skies = [
        ((0.2, 0.4, 0.85), (0.95, 0.8, 0.5)),
        ((0.9, 0.45, 0.2), (1.0, 0.85, 0.45)),
        ((0.1, 0.55, 0.6), (0.8, 0.9, 0.7)),
    ]
    grounds = [
        ((0.25, 0.55, 0.15), (0.1, 0.3, 0.1)),
        ((0.75, 0.55, 0.15), (0.45, 0.25, 0.1)),
        ((0.35, 0.25, 0.5), (0.15, 0.1, 0.3)),
    ]
    st, sb = skies[int(c.rng.integers(3))]
    gt, gb = grounds[int(c.rng.integers(3))]
    img = _vgrad(c, st, sb, 0, h).copy()
    hill = h - 0.15 * S * _noise(c, 1, 3, fy=np.zeros_like(c.X), fx=c.X)
    _paint(img, c.Y >= hill, _vgrad(c, gt, gb, h - 0.15 * S, S))
    sx, sy, sr = c.u(0.1, 0.9) * S, c.u(0.05, 0.25) * S, c.u(0.05, 0.09) * S
    sun = (c.X - sx) ** 2 + (c.Y - sy) ** 2 < sr * sr
    _paint(img, sun & (c.Y < hill), _rgb(1.0, 0.95, 0.6))
    return img


def _bg_paper(c: _Ctx):
    S = c.S
    papers = [(0.95, 0.92, 0.84), (0.8, 0.66, 0.48), (0.86, 0.92, 0.97), (0.98, 0.86, 0.88)]
    base = _jitter(c, papers[int(c.rng.integers(len(papers)))], 0.03, 0.02)
    fib = _fbm(c, 40, 2, aniso=(0.25, 1.0))
    img = base * (0.93 + 0.1 * fib)[..., None] * np.ones((S, S, 1), np.float32)
    if c.rng.random() < 0.5:  # ruled lines
        sp = c.u(9, 13)
        line = ((c.Y % sp) < 1.0) & np.ones_like(c.X, bool)
        _paint(img, line, _rgb(0.55, 0.7, 0.9))
    for _ in range(int(c.rng.integers(1, 4))):  # crayon scribbles
        y0 = c.u(0.05, 0.95) * S
        a, f, p = c.u(3, 10), c.u(0.1, 0.4), c.u(0, 6.3)
        xa, xb = sorted(c.u(0, S, 2))
        curve = y0 + a * np.sin(c.X * f + p)
        m = (np.abs(c.Y - curve) < 1.2) & (c.X > xa) & (c.X < xb)
        _paint(img, m, _rgb(*c.u(0.2, 0.9, 3)))
    return img


def _bg_snow(c: _Ctx):
    S = c.S
    img = np.empty((S, S, 3), np.float32)
    img[:] = _jitter(c, (0.93, 0.95, 0.98), 0.02, 0.02)
    shade = _smoothstep(0.35, 0.75, _fbm(c, 2.5, 3))[..., None]
    img = _lerp(img, _rgb(0.72, 0.78, 0.9), shade * 0.6)
    if c.rng.random() < 0.6:  # distant pine tree line under a grey sky
        base = c.u(0.12, 0.3) * S
        per = c.u(4.0, 8.0)
        tri = 1.0 - 2.0 * np.abs((c.X / per + c.u()) % 1.0 - 0.5)
        tops = base - 0.1 * S * tri * (0.5 + 0.5 * _noise(c, 1, 8, fy=np.zeros_like(c.X), fx=c.X))
        sky = c.Y < tops
        trees = (c.Y >= tops) & (c.Y < base)
        _paint(img, sky, _rgb(0.8, 0.83, 0.87))
        _paint(img, trees, _rgb(0.3, 0.37, 0.38))
    return img * (0.97 + 0.03 * _white(c))[..., None]


def _bg_sand(c: _Ctx):
    base = _jitter(c, (0.87, 0.74, 0.52), 0.05, 0.02)
    a = c.u(-0.5, 0.5)
    lam = c.S / c.u(7, 12)
    warp = 10.0 * _fbm(c, 2, 2)
    ph = (c.Y * np.cos(a) + c.X * np.sin(a) + warp) / lam
    rip = 0.92 + 0.1 * np.sin(_TAU * ph) + 0.08 * (_fbm(c, 3, 2) - 0.5)
    grain = 1.0 + 0.07 * _white(c)
    img = base * (rip * grain)[..., None]
    peb = c.rng.random((c.S, c.S)) < 0.004
    _paint(img, peb, _rgb(0.45, 0.36, 0.26))
    return img.astype(np.float32)


def _bg_street(c: _Ctx):
    S = c.S
    yb = c.u(0.28, 0.42) * S
    img = _vgrad(c, (0.72, 0.75, 0.8), (0.82, 0.83, 0.85), 0, yb).copy()
    # buildings: per-column block index
    edges = np.cumsum(c.u(0.14, 0.32, 12) * S)
    blk = np.searchsorted(edges, c.X[0])  # (S,)
    nb = int(blk.max()) + 1
    tops = c.u(0.0, 0.5, nb) * yb
    pal = np.array(
        [
            (0.6, 0.3, 0.25),
            (0.55, 0.55, 0.58),
            (0.75, 0.68, 0.55),
            (0.45, 0.42, 0.4),
            (0.7, 0.6, 0.5),
        ],
        np.float32,
    )
    cols = pal[c.rng.integers(len(pal), size=nb)] * c.u(0.85, 1.1, (nb, 1)).astype(np.float32)
    left = np.concatenate([[0.0], edges])[blk]
    bmask = (c.Y >= tops[blk][None, :]) & (c.Y < yb)
    bcol = np.broadcast_to(cols[blk][None, :, :], (S, S, 3))
    _paint(img, bmask, bcol)
    wp, hp = c.u(6, 9), c.u(7, 10)
    win = (
        bmask
        & (((c.X - left[None, :]) % wp) < wp * 0.5)
        & (((c.Y - tops[blk][None, :]) % hp) > hp * 0.45)
    )
    win &= (c.X - left[None, :]) > 2
    lit = _noise(c, 6, 10) > 0.6
    _paint(img, win & lit, _rgb(0.95, 0.85, 0.5))
    _paint(img, win & ~lit, _rgb(0.22, 0.26, 0.32))
    # sidewalk + curb
    sw = yb + c.u(0.05, 0.09) * S
    side = (c.Y >= yb) & (c.Y < sw) & np.ones_like(c.X, bool)
    _paint(img, side, _rgb(0.66, 0.65, 0.62))
    _paint(img, side & ((c.X % 9) < 1), _rgb(0.5, 0.5, 0.48))
    curb = (c.Y >= sw) & (c.Y < sw + 2) & np.ones_like(c.X, bool)
    _paint(img, curb, _rgb(0.85, 0.85, 0.82))
    # asphalt with lane markings
    g = c.u(0.36, 0.46)
    asp = g * (0.92 + 0.12 * _fbm(c, 20, 2) + 0.04 * _white(c))
    road = (c.Y >= sw + 2) & np.ones_like(c.X, bool)
    _paint(img, road, np.repeat(asp[..., None], 3, axis=2) * _rgb(0.98, 1.0, 1.03))
    ly = sw + 2 + (S - sw) * c.u(0.35, 0.6)
    dash = (np.abs(c.Y - ly) < 1.3) & (((c.X + c.u(0, 20)) % 20) < 11)
    _paint(img, dash, _rgb(0.92, 0.92, 0.9))
    if c.rng.random() < 0.5:
        ly2 = ly + c.u(0.15, 0.3) * S
        _paint(img, (np.abs(c.Y - ly2) < 1.0) & np.ones_like(c.X, bool), _rgb(0.95, 0.78, 0.15))
    if c.rng.random() < 0.5:  # zebra crossing
        zx = c.u(0.1, 0.6) * S
        zebra = road & (c.X > zx) & (c.X < zx + 0.3 * S) & ((c.X % 8) < 4)
        _paint(img, zebra, _rgb(0.88, 0.88, 0.86))
    return img


def _bg_road(c: _Ctx):
    S = c.S
    h = c.u(0.22, 0.38) * S
    img = _vgrad(c, (0.62, 0.7, 0.8), (0.9, 0.9, 0.88), 0, h).copy()
    verge = _jitter(c, [(0.42, 0.48, 0.28), (0.6, 0.55, 0.4)][int(c.rng.integers(2))], 0.05)
    ground = (c.Y >= h) & np.ones_like(c.X, bool)
    _paint(img, ground, verge * (0.85 + 0.3 * _fbm(c, 10, 2))[..., None])
    vx = c.u(0.35, 0.65) * S
    t = np.clip((c.Y - h) / (S - h), 0.0, 1.0)
    hw = c.u(0.55, 0.95) * S * t + 0.5
    ax = np.abs(c.X - vx)
    road = ground & (ax < hw)
    g = c.u(0.16, 0.24)
    asp = g * (0.9 + 0.15 * _fbm(c, 24, 2) + 0.05 * _white(c))
    asp = asp * (1.0 - 0.12 * (np.abs(np.abs(c.X - vx) / np.maximum(hw, 1) - 0.5) < 0.08))
    _paint(img, road, np.repeat(asp[..., None], 3, axis=2))
    lw = 0.5 + 2.2 * t
    edge = road & (np.abs(ax - hw * 0.92) < lw)
    _paint(img, edge, _rgb(0.92, 0.92, 0.9))
    dashes = ((3.0 / (t + 0.06) + c.u(0, 1)) % 1.0) < 0.5
    for off in (0.0, -0.46, 0.46):
        line = road & (np.abs(c.X - vx - off * hw) < lw * 0.8)
        if off == 0.0:
            _paint(img, line, _rgb(0.95, 0.8, 0.2))
        else:
            _paint(img, line & dashes, _rgb(0.92, 0.92, 0.9))
    return img


def _bg_water(c: _Ctx):
    tops = [((0.04, 0.22, 0.42), (0.1, 0.45, 0.7)), ((0.03, 0.35, 0.45), (0.1, 0.6, 0.68))]
    t0, t1 = tops[int(c.rng.integers(2))]
    img = _vgrad(c, t0, t1)
    lam = c.S / c.u(8, 14)
    warp = 0.9 * _fbm(c, 3, 2)
    ph = _TAU * (c.Y / lam + warp) + 0.8 * np.sin(_TAU * c.X / (lam * c.u(2.5, 4)))
    wave = np.sin(ph)
    img = img * (0.85 + 0.22 * wave)[..., None]
    hi = (wave > 0.82) & (_noise(c, 5, 10) > 0.5)
    img = np.where(hi[..., None], _lerp(img, _rgb(0.75, 0.92, 1.0), 0.6), img)
    c.extra["water"] = _rgb(*np.asarray(t1) * 0.9)
    return img.astype(np.float32)


def _bg_grass(c: _Ctx):
    a = _jitter(c, (0.52, 0.64, 0.16), 0.08)
    b = _jitter(c, (0.12, 0.38, 0.08), 0.08)
    t = _fbm(c, 3, 3)[..., None]
    img = _lerp(a, b, _smoothstep(0.3, 0.7, t))
    slant = c.u(-0.35, 0.35)
    blades = _noise(c, c.S / 14.0, c.S / 1.6, fy=c.Y, fx=c.X + slant * c.Y)
    img = img * (0.55 + 0.75 * blades)[..., None] * (1.0 + 0.06 * _white(c))[..., None]
    return img.astype(np.float32)


def _bg_indoor(c: _Ctx):
    S = c.S
    yf = c.u(0.45, 0.68) * S
    wall = _jitter(
        c, [(0.9, 0.85, 0.72), (0.75, 0.82, 0.78), (0.85, 0.75, 0.7)][int(c.rng.integers(3))], 0.04
    )
    sp = c.u(6, 12)
    paper = 1.0 - 0.05 * ((c.X % sp) < sp / 2)
    img = np.broadcast_to(wall * paper[..., None], (S, S, 3)).astype(np.float32).copy()
    # wooden floor planks
    ph = c.u(5, 9)
    plank = np.floor(c.Y / ph)
    tone = 0.8 + 0.3 * ((plank * 0.6180339 + c.u()) % 1.0)
    grain = _noise(c, S / 20.0, S / 2.5)
    wood = _rgb(0.58, 0.38, 0.2) * (tone * (0.85 + 0.3 * grain))[..., None]
    wood = np.where(((c.Y % ph) < 1.0)[..., None], wood * 0.6, wood)
    floor = (c.Y >= yf) & np.ones_like(c.X, bool)
    _paint(img, floor, wood)
    _paint(img, (np.abs(c.Y - yf) < 2) & np.ones_like(c.X, bool), _rgb(0.95, 0.93, 0.88))
    # furniture-like clutter
    for _ in range(int(c.rng.integers(2, 5))):
        kind = int(c.rng.integers(3))
        w, hh = c.u(0.15, 0.4) * S, c.u(0.12, 0.3) * S
        x0 = c.u(-0.1, 0.9) * S
        if kind == 0:  # window / picture frame on the wall
            y0 = c.u(0.05, 0.6) * (yf - hh)
            box = (c.X > x0) & (c.X < x0 + w) & (c.Y > y0) & (c.Y < y0 + hh)
            inner = (c.X > x0 + 3) & (c.X < x0 + w - 3) & (c.Y > y0 + 3) & (c.Y < y0 + hh - 3)
            _paint(img, box, _rgb(0.45, 0.3, 0.18))
            _paint(img, inner, _jitter(c, (0.65, 0.8, 0.92), 0.15))
            _paint(img, inner & (np.abs(c.X - x0 - w / 2) < 1.0), _rgb(0.45, 0.3, 0.18))
        elif kind == 1:  # table / cabinet standing on the floor line
            y1 = yf + c.u(0.0, 0.2) * S
            top = y1 - hh
            wood2 = _jitter(c, (0.45, 0.28, 0.15), 0.15)
            body = (c.X > x0) & (c.X < x0 + w) & (c.Y > top) & (c.Y < top + 0.25 * hh)
            legs = (
                ((np.abs(c.X - x0 - 2) < 1.5) | (np.abs(c.X - x0 - w + 2) < 1.5))
                & (c.Y > top)
                & (c.Y < y1)
            )
            _paint(img, body | legs, wood2)
        else:  # rug on the floor
            ry = c.u(yf, S)
            rug = ((c.X - x0 - w / 2) / (w / 2)) ** 2 + ((c.Y - ry) / (hh / 3)) ** 2 < 1
            _paint(img, rug, _jitter(c, (0.6, 0.25, 0.2), 0.25))
    return img


def _bg_mountain(c: _Ctx):
    S = c.S
    img = _vgrad(c, (0.25, 0.45, 0.82), (0.8, 0.87, 0.95), 0, 0.55 * S).copy()
    nl = int(c.rng.integers(2, 4))
    far = [(0.58, 0.63, 0.74), (0.45, 0.45, 0.5), (0.34, 0.32, 0.27)]
    near = [(0.3, 0.36, 0.22), (0.38, 0.3, 0.22)][int(c.rng.integers(2))]
    xs = c.X[0]
    rock = 0.8 + 0.35 * _fbm(
        c, 6, 2, aniso=(1.0, 2.0), fy=c.Y + 0.8 * c.X, fx=c.X
    )  # slanted strata
    for li in range(nl):
        base = (0.45 + 0.55 * (li + 1) / nl) * S
        npk = int(c.rng.integers(2, 5))
        px = c.u(-0.1, 1.1, npk) * S
        ph = c.u(0.25, 0.55, npk) * S * (1.2 - 0.25 * li)
        sl = c.u(0.7, 1.6, npk)
        prof = np.max(ph[:, None] - sl[:, None] * np.abs(xs[None, :] - px[:, None]), axis=0)
        jag = 0.03 * S * (_noise(c, 1, 18, fy=np.zeros_like(c.X), fx=c.X)[0] - 0.5)
        ridge = base - np.maximum(prof, 0.04 * S) + jag
        m = c.Y >= ridge[None, :]
        col = _rgb(*(near if li == nl - 1 and nl > 1 else far[li]))
        shade = 1.0 + 0.15 * (c.X < px[np.argmax(ph)])
        layer = col * (rock * shade)[..., None]
        if li < nl - 1 or nl == 1:  # snow caps on farther ridges
            snowline = ridge.min() + 0.12 * S
            cap = c.Y < snowline + 3 * np.sin(c.X * 0.5)
            layer = np.where(cap[..., None], _rgb(0.93, 0.95, 0.98) * rock[..., None] ** 0.3, layer)
        _paint(img, m, layer)
    return img


def _bg_sky(c: _Ctx):
    tops = [((0.08, 0.28, 0.72), (0.55, 0.76, 0.96)), ((0.15, 0.4, 0.85), (0.7, 0.85, 0.98))]
    t0, t1 = tops[int(c.rng.integers(2))]
    img = _vgrad(c, t0, t1)
    cl = _fbm(c, 3, 4)
    thr = c.u(0.5, 0.6)
    cover = _smoothstep(thr, thr + 0.12, cl)[..., None]
    shade = (0.75 + 0.3 * _smoothstep(thr, thr + 0.25, _fbm(c, 3, 2)))[..., None]
    img = _lerp(img, np.clip(_rgb(1.0, 1.0, 1.0) * shade, 0, 1), cover * 0.95)
    c.extra["haze"] = _rgb(*t1)
    c.extra["haze_amt"] = c.u(0.18, 0.32)
    return img.astype(np.float32)


def _bg_tree(c: _Ctx):
    S = c.S
    img = _lerp(
        _rgb(0.72, 0.82, 0.88),
        _rgb(0.18, 0.3, 0.14),
        _smoothstep(0.3, 0.45, _fbm(c, 4, 3))[..., None],
    )
    for _ in range(int(c.rng.integers(2, 6))):  # trunks
        x0, lean, w = c.u(0, 1) * S, c.u(-0.15, 0.15), c.u(0.02, 0.06) * S
        bark = 0.75 + 0.4 * _noise(c, S / 12.0, S / 2.0)
        trunk = np.abs(c.X - x0 - lean * c.Y) < w
        _paint(img, trunk, _rgb(0.36, 0.23, 0.13) * bark[..., None])
    greens = [(0.1, 0.32, 0.08), (0.22, 0.48, 0.12), (0.05, 0.22, 0.06), (0.35, 0.55, 0.15)]
    for li in range(3):  # foliage blob layers
        blobs = _fbm(c, 3 + 2 * li, 3)
        m = blobs > c.u(0.52, 0.6)
        leaf = 0.75 + 0.45 * _noise(c, S / 3.0)
        g = _jitter(c, greens[int(c.rng.integers(len(greens)))], 0.1)
        _paint(img, m, g * leaf[..., None])
    return img


_BACKGROUNDS: dict[str, Callable[[_Ctx], np.ndarray]] = {
    "dim": _bg_dusk,
    "painting": _bg_painting,
    "snow": _bg_snow,
    "sand": _bg_sand,
    "handmade": _bg_paper,
    "street": _bg_street,
    "road": _bg_road,
    "water": _bg_water,
    "grass": _bg_grass,
    "indoor": _bg_indoor,
    "mountain": _bg_mountain,
    "sky": _bg_sky,
    "tree": _bg_tree,
    "occlusion": _bg_generic,
}


# --------------------------------------------------------------------------- #
# Foreground occluders (counted as occlusion: they reduce visible area)
# --------------------------------------------------------------------------- #
def _box_of(m):
    ys = np.flatnonzero(m.any(1))
    xs = np.flatnonzero(m.any(0))
    return xs[0], ys[0], xs[-1] + 1, ys[-1] + 1


def _fg_occlusion(c: _Ctx, canvas, idmap, full, objs):
    S, n = c.S, full.shape[0]
    order = c.rng.permutation(n)
    for k in order:
        if c.rng.random() < 0.1:
            continue
        o = objs[k]
        R = o["R"]
        for _try in range(5):
            a = c.u(0, 2 * np.pi)
            if c.rng.random() < 0.55:  # bar
                off = c.u(0.2, 0.9) * R
                bx, by = o["cx"] + off * np.cos(a), o["cy"] + off * np.sin(a)
                t = c.u(0, np.pi)
                hl, hw = c.u(1.0, 3.0) * R, max(c.u(0.22, 0.5) * R, 1.5)
                du = (c.X - bx) * np.cos(t) + (c.Y - by) * np.sin(t)
                dv = -(c.X - bx) * np.sin(t) + (c.Y - by) * np.cos(t)
                occ = (np.abs(du) < hl) & (np.abs(dv) < hw)
            else:  # irregular blob
                off = c.u(0.6, 1.1) * R
                bx, by = o["cx"] + off * np.cos(a), o["cy"] + off * np.sin(a)
                rr = c.u(0.5, 0.9) * R
                phi = np.arctan2(c.Y - by, c.X - bx)
                w = c.u(0, 6.3, 2)
                rad = rr * (1 + 0.2 * np.sin(3 * phi + w[0]) + 0.1 * np.sin(7 * phi + w[1]))
                occ = (c.X - bx) ** 2 + (c.Y - by) ** 2 < rad**2
            pal = [
                (0.45, 0.42, 0.4),
                (0.35, 0.25, 0.18),
                (0.2, 0.22, 0.25),
                (0.6, 0.58, 0.5),
                (0.3, 0.35, 0.3),
            ]
            base = _jitter(c, pal[int(c.rng.integers(len(pal)))], 0.15)
            col = base * (0.8 + 0.35 * _fbm(c, 10, 2))[..., None]
            if _try_occluder(canvas, idmap, full, occ, col, 0.55):
                break
    # plus a random long bar across the image (may miss everything)
    for _ in range(int(c.rng.integers(0, 3))):
        x = c.u(0, 1) * S
        w = c.u(0.03, 0.07) * S
        lean = c.u(-0.4, 0.4)
        occ = np.abs(c.X - x - lean * c.Y) < w
        _try_occluder(canvas, idmap, full, occ, _jitter(c, (0.5, 0.45, 0.4), 0.3), 0.6)


def _fg_grass(c: _Ctx, canvas, idmap, full, objs):
    """Grass blades in front of the lower part of objects (the background grass, lit)."""
    S = c.S
    colh = 0.35 * _noise(c, 1, S / 6.0, fy=np.zeros_like(c.X), fx=c.X) + 0.65 * c.rng.random((1, S))
    gaps = c.rng.random((1, S)) > 0.3
    blades = np.clip(c.extra["bg"] * 1.12, 0.0, 1.0)
    for k in range(full.shape[0]):
        if c.rng.random() < 0.3 or not full[k].any():
            continue
        x0, y0, x1, y1 = _box_of(full[k])
        hb = c.u(0.25, 0.5) * (y1 - y0) + 2
        occ = (c.Y > y1 - hb * colh) & (c.Y < y1) & (c.X > x0 - 2) & (c.X < x1 + 2) & gaps
        _try_occluder(canvas, idmap, full, occ, blades, 0.4)


def _fg_tree(c: _Ctx, canvas, idmap, full, objs):
    for k in range(full.shape[0]):
        if c.rng.random() < 0.6:
            continue
        o = objs[k]
        a = c.u(0, 2 * np.pi)
        bx, by = o["cx"] + 1.1 * o["R"] * np.cos(a), o["cy"] + 1.1 * o["R"] * np.sin(a)
        rr = c.u(0.5, 0.9) * o["R"] + 2
        nz = _noise(c, c.S / 8.0)
        occ = ((c.X - bx) ** 2 + (c.Y - by) ** 2) < (rr * (0.75 + 0.5 * nz)) ** 2
        col = _jitter(c, (0.15, 0.4, 0.1), 0.15) * (0.7 + 0.5 * _noise(c, c.S / 3.0))[..., None]
        _try_occluder(canvas, idmap, full, occ, col, 0.4)


def _fg_snow(c: _Ctx, canvas, idmap, full, objs):
    wig = _noise(c, 1, c.S / 6.0, fy=np.zeros_like(c.X), fx=c.X)
    snowcol = _rgb(0.95, 0.96, 0.99) * (0.92 + 0.08 * _noise(c, c.S / 6.0))[..., None]
    for k in range(full.shape[0]):
        if c.rng.random() < 0.4 or not full[k].any():
            continue
        _, y0, _, y1 = _box_of(full[k])
        ch = c.u(0.1, 0.3) * (y1 - y0) + 1
        occ = full[k] & (idmap == k + 1) & (c.Y < y0 + ch * (0.6 + 0.8 * wig))
        _try_occluder(canvas, idmap, full, occ, snowcol, 0.35)


_FOREGROUND = {"occlusion": _fg_occlusion, "grass": _fg_grass, "tree": _fg_tree, "snow": _fg_snow}


# --------------------------------------------------------------------------- #
# Whole-image effects
# --------------------------------------------------------------------------- #
def _shift(img, dy: int, dx: int):
    """Shift with edge replication (no wrap-around)."""
    S = img.shape[0]
    iy = np.clip(np.arange(S) - dy, 0, S - 1)
    ix = np.clip(np.arange(S) - dx, 0, S - 1)
    return img[iy][:, ix]


def _fx_dim(c: _Ctx, img, idmap, full):
    img = np.power(np.clip(img, 0, 1), c.u(1.15, 1.45)) * c.u(0.14, 0.24)
    img = img * _rgb(0.85, 0.92, 1.2)
    sig = c.u(0.012, 0.025)
    img = img + sig * (_white(c)[..., None] + 0.6 * _white(c, (c.S, c.S, 3)))
    return img, idmap, full


def _fx_painting(c: _Ctx, img, idmap, full):
    a = c.u(0, np.pi)
    ca, sa = np.cos(a), np.sin(a)
    acc = img.copy()
    for k in (-2, -1, 1, 2):  # directional smear along brush direction
        acc += _shift(img, round(k * sa), round(k * ca))
    img = acc / 5.0
    lum = img.mean(2)
    gy = np.abs(np.diff(lum, axis=0, append=lum[-1:]))
    gx = np.abs(np.diff(lum, axis=1, append=lum[:, -1:]))
    ink = (gx + gy) > c.u(0.12, 0.18)
    fu = c.X * ca + c.Y * sa
    fv = -c.X * sa + c.Y * ca
    strokes = _noise(c, c.S / 3.5, c.S / 14.0, fy=fv, fx=fu)
    img = img * (0.82 + 0.36 * strokes)[..., None] + 0.08 * (_noise(c, c.S / 8.0) - 0.5)[..., None]
    m = img.mean(2, keepdims=True)
    img = m + (img - m) * 1.35  # saturated paint
    L = int(c.rng.integers(4, 7))
    img = np.round(np.clip(img, 0, 1) * (L - 1)) / (L - 1)
    img = np.where(ink[..., None], img * 0.45, img)
    weave = 1.0 + 0.05 * np.sin(c.X * 2.1) * np.sin(c.Y * 2.1)
    return img * weave[..., None], idmap, full


def _fx_snow(c: _Ctx, img, idmap, full):
    S = c.S
    h = c.u(0.25, 0.4)
    img = _lerp(img, _rgb(0.9, 0.92, 0.96), h)  # low contrast, bright haze
    nfl = int(S * S * c.u(0.025, 0.06))
    ys = c.rng.integers(0, S, nfl)
    xs = c.rng.integers(0, S, nfl)
    al = c.rng.uniform(0.5, 0.95, nfl).astype(np.float32)[:, None]
    img[ys, xs] = _lerp(img[ys, xs], _rgb(1, 1, 1), al)
    big = c.rng.random(nfl) < 0.3
    ys2, xs2 = np.minimum(ys[big] + 1, S - 1), np.minimum(xs[big] + 1, S - 1)
    for yy, xx in ((ys2, xs[big]), (ys[big], xs2), (ys2, xs2)):
        img[yy, xx] = _lerp(img[yy, xx], _rgb(1, 1, 1), al[big])
    return img, idmap, full


def _fx_sand(c: _Ctx, img, idmap, full):
    img = img * _rgb(1.06, 0.95, 0.78)
    img = _lerp(img, _rgb(0.85, 0.72, 0.52), 0.12)
    img = img * (1.0 + 0.05 * _white(c))[..., None]
    return img, idmap, full


def _fx_handmade(c: _Ctx, img, idmap, full):
    tex = 0.94 + 0.08 * _fbm(c, c.S / 4.0, 1)
    return img * tex[..., None], idmap, full


def _fx_water(c: _Ctx, img, idmap, full):
    S = c.S
    amp = c.u(0.8, 1.8)
    l1, l2 = c.u(12, 22), c.u(14, 28)
    p1, p2 = c.u(0, 6.3, 2)
    dx = amp * np.sin(_TAU * c.Y / l1 + p1 + 0.3 * np.sin(_TAU * c.X / l2)) * np.ones_like(c.X)
    dy = 0.6 * amp * np.sin(_TAU * c.X / l2 + p2) * np.ones_like(c.Y)
    sx = np.clip(c.X - 0.5 + dx, 0, S - 1)
    sy = np.clip(c.Y - 0.5 + dy, 0, S - 1)
    x0 = np.floor(sx).astype(np.intp)
    y0 = np.floor(sy).astype(np.intp)
    x1, y1 = np.minimum(x0 + 1, S - 1), np.minimum(y0 + 1, S - 1)
    tx, ty = (sx - x0)[..., None], (sy - y0)[..., None]
    top = img[y0, x0] * (1 - tx) + img[y0, x1] * tx
    bot = img[y1, x0] * (1 - tx) + img[y1, x1] * tx
    out = top * (1 - ty) + bot * ty
    ny, nx = np.rint(sy).astype(np.intp), np.rint(sx).astype(np.intp)
    idmap = idmap[ny, nx]
    full = full[:, ny, nx]
    glint = (_noise(c, S / 4.0) > 0.8) & (c.rng.random((S, S)) < 0.25)
    out = np.where(glint[..., None], _lerp(out, _rgb(1, 1, 1), 0.5), out)
    return out, idmap, full


def _fx_sky(c: _Ctx, img, idmap, full):
    return img * (1.0 + 0.02 * _white(c))[..., None], idmap, full


def _fx_tree(c: _Ctx, img, idmap, full):
    dapple = 0.72 + 0.45 * _smoothstep(0.35, 0.65, _fbm(c, 5, 2))
    return img * dapple[..., None], idmap, full


def _fx_indoor(c: _Ctx, img, idmap, full):
    lx, ly = c.u(0.2, 0.8) * c.S, c.u(0.0, 0.3) * c.S
    fall = np.exp(-((c.X - lx) ** 2 + (c.Y - ly) ** 2) / (0.35 * c.S * c.S))
    img = img * _rgb(1.12, 0.98, 0.76) * (0.7 + 0.45 * fall)[..., None]
    return img, idmap, full


def _fx_street(c: _Ctx, img, idmap, full):
    m = img.mean(2, keepdims=True)
    return _lerp(img, m, 0.2), idmap, full


def _fx_mountain(c: _Ctx, img, idmap, full):
    return _lerp(img, _rgb(0.75, 0.82, 0.92), 0.08), idmap, full


def _fx_none(c: _Ctx, img, idmap, full):
    return img, idmap, full


_EFFECTS = {
    "dim": _fx_dim,
    "painting": _fx_painting,
    "snow": _fx_snow,
    "sand": _fx_sand,
    "handmade": _fx_handmade,
    "street": _fx_street,
    "road": _fx_none,
    "water": _fx_water,
    "grass": _fx_none,
    "indoor": _fx_indoor,
    "mountain": _fx_mountain,
    "sky": _fx_sky,
    "tree": _fx_tree,
    "occlusion": _fx_none,
}

_SIZE_RANGE = {"sky": (0.03, 0.085)}
_DEFAULT_SIZE = (0.045, 0.17)


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #
def render_example(
    rng: np.random.Generator,
    domain: str,
    size: int,
    max_objects: int = 6,
    *,
    return_masks: bool = False,
) -> dict:
    """Render one synthetic detection example in ``domain``.

    Args:
      rng: source of all randomness (the result is a pure function of its state).
      domain: one of :data:`DOMAINS`.
      size: image side in pixels (square image), >= 32.
      max_objects: objects per image are drawn uniformly from ``1..max_objects``
        (placement may drop one that finds no room; at least one is kept).
      return_masks: also return ``"masks"``: bool ``[n, size, size]`` visible masks.

    Returns:
      dict with ``image`` uint8 [size, size, 3], ``boxes`` float32 [n, 4] (x, y, w, h
      absolute pixels: the tight box of the object's own mask before occlusion, clipped to
      the image, edges on pixel boundaries), ``labels`` int32 [n] (indices into
      :data:`CLASS_NAMES`), ``area`` float32 [n] (visible pixel count after occlusion, like
      COCO segmentation areas, so ``area <= w * h``), ``is_crowd`` bool [n] (always False).
    """
    if domain not in _DOMAIN_INDEX:
        raise ValueError(f"unknown synthetic domain {domain!r}; expected one of {DOMAINS}")
    size = int(size)
    if size < 32:
        raise ValueError(f"size must be >= 32, got {size}")
    if int(max_objects) < 1:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    c = _Ctx(rng, size)
    canvas = np.array(_BACKGROUNDS[domain](c), dtype=np.float32)
    c.extra["bg"] = canvas.copy()
    n_req = int(rng.integers(1, int(max_objects) + 1))
    objs = _sample_objects(c, n_req, _SIZE_RANGE.get(domain, _DEFAULT_SIZE))
    n = len(objs)
    idmap = np.zeros((size, size), np.int16)
    full = np.zeros((n, size, size), bool)
    for k, o in enumerate(objs):
        _draw_object(c, canvas, idmap, full, k, o, domain)
    if domain in _FOREGROUND:
        _FOREGROUND[domain](c, canvas, idmap, full, objs)
    canvas, idmap, full = _EFFECTS[domain](c, canvas, idmap, full)
    image = np.clip(canvas * 255.0 + 0.5, 0, 255).astype(np.uint8)

    boxes, labels, areas, masks = [], [], [], []
    vis_counts = np.bincount(idmap.ravel(), minlength=n + 1)
    for k, o in enumerate(objs):
        if vis_counts[k + 1] == 0 or not full[k].any():
            continue
        x0, y0, x1, y1 = _box_of(full[k])
        boxes.append((x0, y0, x1 - x0, y1 - y0))
        labels.append(o["cls"])
        areas.append(vis_counts[k + 1])
        if return_masks:
            masks.append(idmap == k + 1)
    m = len(labels)
    out = {
        "image": image,
        "boxes": np.asarray(boxes, np.float32).reshape(m, 4),
        "labels": np.asarray(labels, np.int32).reshape(m),
        "area": np.asarray(areas, np.float32).reshape(m),
        "is_crowd": np.zeros((m,), bool),
    }
    if return_masks:
        out["masks"] = np.asarray(masks, bool).reshape(m, size, size)
    return out


def image_id(seed: int, domain: str, index: int) -> int:
    """Stable int64-safe image id, unique per (seed, domain, index).

    Layout: ``blake2b(seed)`` 28 bits | domain index 4 bits | example index 31 bits.
    Within one seed ids are unique by construction (across all domains); across
    seeds they differ unless the 28-bit seed hashes collide.
    """
    if domain not in _DOMAIN_INDEX:
        raise ValueError(f"unknown synthetic domain {domain!r}; expected one of {DOMAINS}")
    index = int(index)
    if not 0 <= index < 2**31:
        raise ValueError(f"index must be in [0, 2**31), got {index}")
    h = hashlib.blake2b(f"synthetic_shifts/{int(seed)}".encode(), digest_size=8).digest()
    tag = int.from_bytes(h, "little") & ((1 << 28) - 1)
    return (((tag << 4) | _DOMAIN_INDEX[domain]) << 31) | index


def split_example(
    seed: int, domain: str, index: int, size_range=(128, 160), max_objects: int = 6
) -> dict:
    """Example ``index`` of ``render_split(seed, domain, ...)``, rendered on its own."""
    if domain not in _DOMAIN_INDEX:
        raise ValueError(f"unknown synthetic domain {domain!r}; expected one of {DOMAINS}")
    lo, hi = int(size_range[0]), int(size_range[1])
    if hi < lo:
        raise ValueError(f"bad size_range {size_range}")
    ss = np.random.SeedSequence([int(seed), _DOMAIN_INDEX[domain], int(index)])
    rng = np.random.default_rng(ss)
    size = int(rng.integers(lo, hi + 1))
    ex = render_example(rng, domain, size, max_objects)
    ex["image/id"] = image_id(seed, domain, index)
    return ex


def render_split(
    seed: int, domain: str, num_examples: int, size_range=(128, 160), max_objects: int = 6
) -> Iterator[dict]:
    """Yield ``num_examples`` examples; sizes drawn uniformly from ``size_range`` (inclusive).

    Example ``i`` uses its own rng from ``SeedSequence([seed, domain_index, i])``,
    so any example can be regenerated independently (see :func:`split_example`).
    """
    # Validate eagerly (a generator body would only run on the first next()).
    if domain not in _DOMAIN_INDEX:
        raise ValueError(f"unknown synthetic domain {domain!r}; expected one of {DOMAINS}")
    if int(size_range[1]) < int(size_range[0]) or int(size_range[0]) < 32:
        raise ValueError(f"bad size_range {size_range}")
    if int(num_examples) > 2**31:
        raise ValueError(f"num_examples must be <= 2**31, got {num_examples}")
    return (
        split_example(seed, domain, i, size_range, max_objects) for i in range(int(num_examples))
    )
