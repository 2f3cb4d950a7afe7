"""Tests for the procedural ``synthetic`` (synthetic_shifts) COUNTS stand-in."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ood_jax.data import synthetic_render as sr

EXPECTED_DOMAINS = [
    "dim", "painting", "snow", "sand", "handmade", "street", "road", "water", "grass", "indoor",
    "mountain", "sky", "tree", "occlusion",
]  # fmt: skip


def _examples(domain, n, size=96, seed=11, max_objects=6, masks=False):
    rng = np.random.default_rng([seed, sr.DOMAINS.index(domain)])
    return [sr.render_example(rng, domain, size, max_objects, return_masks=masks) for _ in range(n)]


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, val in a.items():
        va, vb = np.asarray(val), np.asarray(b[k])
        if va.dtype != vb.dtype or va.shape != vb.shape or va.tobytes() != vb.tobytes():
            return False
    return True


# --------------------------------------------------------------------------- #
def test_constants():
    assert tuple(EXPECTED_DOMAINS) == sr.DOMAINS
    assert len(sr.CLASS_NAMES) == 8
    assert len(set(sr.CLASS_NAMES)) == 8


@pytest.mark.parametrize("domain", sr.DOMAINS)
def test_deterministic_given_rng_state(domain):
    a = sr.render_example(np.random.default_rng(5), domain, 120)
    b = sr.render_example(np.random.default_rng(5), domain, 120)
    c = sr.render_example(np.random.default_rng(6), domain, 120)
    assert _same(a, b)
    assert a["image"].tobytes() == b["image"].tobytes()
    assert a["image"].tobytes() != c["image"].tobytes()


@pytest.mark.parametrize("domain", sr.DOMAINS)
def test_valid_annotations(domain):
    for max_objects in (1, 6, 10):
        for i, ex in enumerate(
            _examples(domain, 6, size=100 + 7 * max_objects, max_objects=max_objects)
        ):
            S = 100 + 7 * max_objects
            img = ex["image"]
            assert img.dtype == np.uint8 and img.shape == (S, S, 3)
            n = ex["labels"].shape[0]
            assert 1 <= n <= max_objects, (domain, i, n)
            assert ex["boxes"].dtype == np.float32 and ex["boxes"].shape == (n, 4)
            assert ex["labels"].dtype == np.int32
            assert ex["area"].dtype == np.float32 and ex["area"].shape == (n,)
            assert ex["is_crowd"].dtype == bool and ex["is_crowd"].shape == (n,)
            assert not ex["is_crowd"].any()
            x, y, w, h = ex["boxes"].T
            assert (w > 0).all() and (h > 0).all()
            assert (x >= 0).all() and (y >= 0).all()
            assert (x + w <= S).all() and (y + h <= S).all()
            assert ((0 <= ex["labels"]) & (ex["labels"] < len(sr.CLASS_NAMES))).all()
            assert (ex["area"] > 0).all()
            assert (ex["area"] <= w * h).all()


@pytest.mark.parametrize("domain", sr.DOMAINS)
def test_masks_inside_boxes_and_match_area(domain):
    for ex in _examples(domain, 6, size=112, masks=True):
        masks = ex["masks"]
        assert masks.shape == (len(ex["labels"]), 112, 112)
        assert not (masks.sum(0) > 1).any(), "visible masks must not overlap"
        for m, (x, y, w, h), a in zip(masks, ex["boxes"].astype(int), ex["area"]):
            assert m.sum() == a
            inside = np.zeros_like(m)
            inside[y : y + h, x : x + w] = True
            assert not (m & ~inside).any(), "mask pixels outside the box"


@pytest.mark.parametrize("domain", ["road", "street", "indoor", "mountain"])
def test_unoccluded_single_object_box_is_tight(domain):
    # No occluders and no geometric warp in these domains: with one object the box
    # is exactly the extent of the visible mask.
    for ex in _examples(domain, 8, size=128, max_objects=1, masks=True):
        (m,), (box,) = ex["masks"], ex["boxes"]
        ys, xs = np.nonzero(m)
        assert tuple(box) == (xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min())


def test_area_is_mask_area_not_box_area():
    ratios = {c: [] for c in range(len(sr.CLASS_NAMES))}
    for ex in _examples("road", 40, size=128, max_objects=1):
        (_, _, w, h), lab, a = ex["boxes"][0], ex["labels"][0], ex["area"][0]
        ratios[int(lab)].append(a / (w * h))
    circle = np.median(ratios[sr.CLASS_NAMES.index("circle")])
    assert 0.65 < circle < 0.9  # ~ pi/4 for a disc
    everything = np.concatenate([r for r in ratios.values() if r])
    assert (everything < 0.999).mean() > 0.8


def test_class_colour_families():
    """Texture/colour carries the label: mean visible-pixel colour per class."""
    acc = {c: [] for c in range(len(sr.CLASS_NAMES))}
    for ex in _examples("road", 60, size=128, masks=True):
        img = ex["image"].astype(np.float32) / 255.0
        for m, lab in zip(ex["masks"], ex["labels"]):
            acc[int(lab)].append(img[m].mean(0))
    mean = {sr.CLASS_NAMES[c]: np.mean(v, 0) for c, v in acc.items()}
    assert all(len(v) >= 5 for v in acc.values())
    r, g, b = mean["circle"]
    assert r > g + 0.3 and r > b + 0.3
    r, g, b = mean["square"]
    assert b > r + 0.15 and b > g + 0.1
    r, g, b = mean["triangle"]
    assert r > g > b + 0.1
    assert np.ptp(mean["cross"]) < 0.08  # black/white checker: grey on average
    r, g, b = mean["ring"]
    assert b > g + 0.1 and r > g
    r, g, b = mean["star"]
    assert r > 0.6 and g > 0.5 and b < r - 0.25
    r, g, b = mean["diamond"]
    assert g > r + 0.2 and b > r + 0.2
    r, g, b = mean["bar"]
    assert r > b > g
    cols = np.stack(list(mean.values()))
    d = np.linalg.norm(cols[:, None] - cols[None], axis=-1) + np.eye(len(cols))
    assert d.min() > 0.1


def test_unknown_domain_raises():
    with pytest.raises(ValueError, match="fog"):
        sr.render_example(np.random.default_rng(0), "fog", 128)
    with pytest.raises(ValueError, match="fog"):
        sr.render_split(0, "fog", 3)  # eager, without iterating
    with pytest.raises(ValueError, match="fog"):
        sr.split_example(0, "fog", 0)


# --------------------------------------------------------------------------- #
def test_render_split_reproducible_per_example():
    split = list(sr.render_split(3, "water", 5))
    assert len(split) == 5
    assert _same(split[3], sr.split_example(3, "water", 3))
    prefix = list(sr.render_split(3, "water", 2))
    assert all(_same(a, b) for a, b in zip(prefix, split))
    other = list(sr.render_split(4, "water", 2))
    assert other[0]["image"].tobytes() != split[0]["image"].tobytes()
    sizes = {ex["image"].shape[0] for ex in sr.render_split(1, "grass", 12, size_range=(128, 160))}
    assert len(sizes) > 1 and min(sizes) >= 128 and max(sizes) <= 160
    for ex in split:
        assert ex["image"].shape[0] == ex["image"].shape[1]


def test_image_ids_unique_and_stable():
    ids = [sr.image_id(s, d, i) for s in (0, 1, 2024) for d in sr.DOMAINS for i in range(25)]
    assert len(set(ids)) == len(ids)
    assert all(isinstance(i, int) and 0 <= i < 2**63 for i in ids)
    assert sr.split_example(0, "sky", 7)["image/id"] == sr.image_id(0, "sky", 7)
    code = "from ood_jax.data import synthetic_render as sr; print(sr.image_id(2024, 'tree', 9))"
    out = set()
    for hs in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hs)
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        out.add(int(res.stdout.strip()))
    assert out == {sr.image_id(2024, "tree", 9)}


# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def domain_images():
    return {
        d: [ex["image"].astype(np.float32) / 255.0 for ex in _examples(d, 10, size=96, seed=3)]
        for d in sr.DOMAINS
    }


def _mean_rgb(ims):
    return np.mean([im.reshape(-1, 3).mean(0) for im in ims], 0)


def test_domains_differ_in_colour_statistics(domain_images):
    m = {d: _mean_rgb(ims) for d, ims in domain_images.items()}
    lum = {d: v.mean() for d, v in m.items()}
    green = {d: v[1] - (v[0] + v[2]) / 2 for d, v in m.items()}
    blue = {d: v[2] - v[0] for d, v in m.items()}
    warm = {d: v[0] - v[2] for d, v in m.items()}

    def others(excluded):
        return [d for d in sr.DOMAINS if d not in excluded]

    # dim: low light
    assert lum["dim"] < 0.4 * min(lum[d] for d in others({"dim"}))
    # snow: the brightest
    assert lum["snow"] > max(lum[d] for d in others({"snow"}))
    # grass and tree are the green ones, grass the greenest
    assert green["grass"] > 0.15 and green["grass"] > max(green[d] for d in others({"grass"}))
    assert green["tree"] > max(green[d] for d in others({"grass", "tree"}))
    # sky and water are the blue ones
    for d in ("sky", "water"):
        assert blue[d] > 0.25 and blue[d] > max(blue[o] for o in others({"sky", "water"}))
    # sand is the warmest
    assert warm["sand"] > max(warm[d] for d in others({"sand"}))


def test_domain_colour_histograms_pairwise_distinct(domain_images):
    hists = {}
    for d, ims in domain_images.items():
        hists[d] = np.mean([_colour_hist(np.round(im * 255).astype(np.uint8)) for im in ims], 0)
    for i, a in enumerate(sr.DOMAINS):
        for b in sr.DOMAINS[i + 1 :]:
            l1 = np.abs(hists[a] - hists[b]).sum()
            assert l1 > 0.25, (a, b, l1)


def _colour_hist(im_u8):
    im = im_u8.astype(np.float32) / 255.0
    h = np.histogramdd(
        np.minimum(im.reshape(-1, 3) * 4, 3.999), bins=(4, 4, 4), range=[(0, 4)] * 3
    )[0]
    return h.ravel() / (im.shape[0] * im.shape[1])


def test_domains_recognisable_by_nearest_neighbour():
    """Each domain is identifiable from a fresh image's colour histogram (1-NN)."""
    train = [
        (_colour_hist(ex["image"]), i)
        for i, d in enumerate(sr.DOMAINS)
        for ex in _examples(d, 12, 96, seed=1)
    ]
    feats = np.stack([f for f, _ in train])
    labels = np.array([lab for _, lab in train])
    accs = []
    for i, d in enumerate(sr.DOMAINS):
        test = np.stack([_colour_hist(ex["image"]) for ex in _examples(d, 10, 96, seed=2)])
        pred = labels[np.abs(test[:, None] - feats[None]).sum(-1).argmin(1)]
        accs.append((pred == i).mean())
    assert min(accs) >= 0.6, dict(zip(sr.DOMAINS, accs))
    assert np.mean(accs) >= 0.85, dict(zip(sr.DOMAINS, accs))


def test_domain_effects_reach_objects():
    def obj_stats(domain, n=12):
        px, vis = [], []
        for ex in _examples(domain, n, size=112, seed=5, masks=True):
            img = ex["image"].astype(np.float32) / 255.0
            for m in ex["masks"]:
                px.append(img[m].mean())
            vis.append(ex["area"] / (ex["boxes"][:, 2] * ex["boxes"][:, 3]))
        return np.mean(px), np.mean(np.concatenate(vis))

    road_lum, road_vis = obj_stats("road")
    dim_lum, _ = obj_stats("dim")
    assert dim_lum < 0.35 * road_lum  # objects themselves are dark
    _, occ_vis = obj_stats("occlusion")
    assert occ_vis < 0.85 * road_vis  # occluders remove visible area

    def median_box_area(domain):
        return np.median(
            np.concatenate(
                [ex["boxes"][:, 2] * ex["boxes"][:, 3] for ex in _examples(domain, 15, 128)]
            )
        )

    assert median_box_area("sky") < 0.5 * median_box_area("road")  # far-away objects
