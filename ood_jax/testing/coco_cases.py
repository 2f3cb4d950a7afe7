"""Random, adversarial COCO bbox evaluation cases, for the parity tests, the benchmark and demos.

A case is a COCO-format ground-truth dict plus a list of detection dicts, exactly what
``pycocotools`` consumes (``COCO().dataset = gt``, ``loadRes(detections)``), generated to
exercise every corner of COCOeval's semantics (docs/guide/coco-evaluation.md). Generation is
vectorized numpy and deterministic for a seed; ``val2017_like``'s 5000 images x 100 detections
take about a second.
"""

from __future__ import annotations

import numpy as np

__all__ = ["random_case", "val2017_like", "case_summary"]

SMALL_AREA = 32.0**2
MEDIUM_AREA = 96.0**2


def _count(fraction: float, n: int) -> int:
    """round(fraction * n), but at least 1 when fraction > 0 and n > 0."""
    if fraction <= 0 or n <= 0:
        return 0
    return int(min(n, max(1, round(fraction * n))))


def _sample_sizes(rng, n, img_w, img_h, lo=3.0, hi=450.0):
    """Box sizes with log-uniform sqrt-area (spans small/medium/large)."""
    s = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    ar = np.exp(rng.normal(0.0, 0.6, n))
    w = np.clip(s * np.sqrt(ar), 1.0, 0.95 * img_w)
    h = np.clip(s / np.sqrt(ar), 1.0, 0.95 * img_h)
    return w, h


def _boxes_inside(rng, parents: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """One xywh box inside each parent xywh box, sides U(lo, hi) of the parent's."""
    n = len(parents)
    w = parents[:, 2] * rng.uniform(lo, hi, n)
    h = parents[:, 3] * rng.uniform(lo, hi, n)
    x = parents[:, 0] + rng.random(n) * (parents[:, 2] - w)
    y = parents[:, 1] + rng.random(n) * (parents[:, 3] - h)
    return np.stack([x, y, w, h], 1)


def _place(rng, w, h, img_w, img_h):
    x = rng.uniform(0.0, 1.0, w.shape) * (img_w - w)
    y = rng.uniform(0.0, 1.0, h.shape) * (img_h - h)
    return x, y


def random_case(
    seed: int,
    num_images: int = 50,
    num_categories: int = 5,
    gt_per_image: float = 7,
    dets_per_image: int = 100,
    crowd_fraction: float = 0.05,
    tie_fraction: float = 0.1,
    empty_image_fraction: float = 0.1,
    unused_category_fraction: float = 0.1,
    detection_only_category_fraction: float = 0.1,
    big_group_fraction: float = 0.05,
    wrong_category_fraction: float = 0.15,
    snap_fraction: float = 0.1,
    exact_iou_fraction: float = 0.03,
    equal_iou_fraction: float = 0.02,
    boundary_area_fraction: float = 0.03,
    duplicate_gt_fraction: float = 0.02,
    duplicate_det_fraction: float = 0.02,
    area_scale: tuple[float, float] = (0.3, 1.0),
    tie_decimals: int = 2,
    copies_per_gt: float = 1.5,
    shuffle: bool = True,
) -> tuple[dict, list[dict]]:
    """Generate a random COCO bbox case ``(gt, detections)``.

    Args:
      seed: RNG seed; the output is a deterministic function of all arguments.
      num_images: number of images listed in ``gt['images']``.
      num_categories: number of categories listed in ``gt['categories']``.
      gt_per_image: mean (Poisson) number of regular ground truths per non-empty
        image (before crowd members and duplicates are added).
      dets_per_image: target detections per image (most images get exactly this
        many, some fewer; big groups add more).
      crowd_fraction: number of crowd regions as a fraction of ground truths.
      tie_fraction: fraction of detections whose score is rounded to
        ``tie_decimals`` decimals.
      empty_image_fraction: fraction of images without ground truth (half of them
        still get background detections).
      unused_category_fraction: fraction of categories with neither ground truth
        nor detections.
      detection_only_category_fraction: fraction of categories with detections
        but no ground truth.
      big_group_fraction: fraction of non-empty images that get one
        (image, category) group with more than 100 detections.
      wrong_category_fraction: fraction of gt-derived detections given a wrong
        category.
      snap_fraction: fraction of boxes rounded to integer coordinates.
      exact_iou_fraction: fraction of ground truths that get a detection whose
        IoU is one of the IoU thresholds (exactly for half of them, within a few
        ulps for the others).
      equal_iou_fraction: fraction of ground truths given a twin box and a
        detection with exactly the same IoU with both (gt IoU-tie rule).
      boundary_area_fraction: fraction of ground truths whose area (and of
        background detections whose w*h) is exactly 32**2 or 96**2.
      duplicate_gt_fraction: fraction of ground truths duplicated (same box,
        different area).
      duplicate_det_fraction: fraction of detections duplicated exactly.
      area_scale: gt ``area = w * h * U(*area_scale)``.
      tie_decimals: decimals used for tied scores.
      copies_per_gt: mean number of extra jittered detections per ground truth
        (each gt gets ``1 + Poisson(copies_per_gt)``).
      shuffle: shuffle images, categories, annotations and detections.

    Returns:
      ``(gt, detections)``: ``gt`` has ``images`` (id, width, height,
      file_name), ``categories`` (id, name, supercategory), ``annotations`` (id
      from 1, image_id, category_id, bbox [x, y, w, h] floats, area, iscrowd);
      ``detections`` is a list of dicts with image_id, category_id, bbox, score.
      All numbers are plain Python ints/floats.
    """
    rng = np.random.default_rng(seed)
    n_img = int(num_images)
    n_cat = int(num_categories)
    if n_img < 1 or n_cat < 1:
        raise ValueError("num_images and num_categories must be >= 1")

    # ---------------------------------------------------------------- images
    image_ids = rng.choice(np.arange(1, max(20 * n_img, 1000) + 1), n_img, replace=False)
    img_w = rng.integers(160, 1025, n_img).astype(np.float64)
    img_h = rng.integers(160, 1025, n_img).astype(np.float64)

    # ------------------------------------------------------------ categories
    cat_ids = np.sort(rng.choice(np.arange(1, 3 * n_cat + 8), n_cat, replace=False))
    role_perm = rng.permutation(n_cat)
    n_unused = _count(unused_category_fraction, n_cat)
    n_detonly = _count(detection_only_category_fraction, n_cat)
    # at least one category must have ground truth
    while n_unused + n_detonly > n_cat - 1 and (n_unused or n_detonly):
        if n_unused >= n_detonly and n_unused:
            n_unused -= 1
        else:
            n_detonly -= 1
    # role_perm[:n_unused] are the categories listed without annotations or detections.
    detonly_cats = cat_ids[role_perm[n_unused : n_unused + n_detonly]]
    gt_cats = np.sort(cat_ids[role_perm[n_unused + n_detonly :]])
    det_cats = np.sort(np.concatenate([gt_cats, detonly_cats]))
    # Zipf-like category frequencies, in a random rank order.
    zipf = 1.0 / (1.0 + rng.permutation(len(gt_cats))) ** 0.8
    gt_cat_p = zipf / zipf.sum()

    # --------------------------------------------------------- empty images
    n_empty = _count(empty_image_fraction, n_img) if n_img > 1 else 0
    n_empty = min(n_empty, n_img - 1)  # keep at least one image with gt
    img_perm = rng.permutation(n_img)
    empty = np.zeros(n_img, bool)
    empty[img_perm[:n_empty]] = True
    blank = np.zeros(n_img, bool)  # no gt and no detections at all
    blank[img_perm[: n_empty // 2]] = True
    nonempty_idx = np.flatnonzero(~empty)

    # ------------------------------------------------------ regular gt boxes
    gt_count = np.maximum(rng.poisson(gt_per_image, n_img), 1)
    gt_count[empty] = 0
    g_img = np.repeat(np.arange(n_img), gt_count)
    n_g = len(g_img)
    g_cat = rng.choice(gt_cats, n_g, p=gt_cat_p)
    w, h = _sample_sizes(rng, n_g, img_w[g_img], img_h[g_img])
    x, y = _place(rng, w, h, img_w[g_img], img_h[g_img])
    g_box = np.stack([x, y, w, h], 1)

    # snapped (integer) boxes
    snap = rng.random(n_g) < snap_fraction
    g_box[snap] = np.round(g_box[snap])
    g_box[snap, 2:] = np.maximum(g_box[snap, 2:], 1.0)

    # threshold-IoU ground truths. Half are integer boxes with w, h multiples of 20,
    # whose cut detection (below) has an IoU exactly equal to a threshold; the other
    # half keep arbitrary float coordinates, so the IoU is within a few ulps of a
    # threshold and the outcome depends on doing bbIou's arithmetic exactly.
    exact = rng.random(n_g) < exact_iou_fraction
    exact_int = exact & (rng.random(n_g) < 0.5)
    n_ex = int(exact_int.sum())
    if n_ex:
        W, H = img_w[g_img[exact_int]], img_h[g_img[exact_int]]
        ew = np.minimum(20.0 * rng.integers(1, 8, n_ex), 20.0 * np.floor((W - 1) / 20))
        eh = np.minimum(20.0 * rng.integers(1, 6, n_ex), 20.0 * np.floor((H - 1) / 20))
        ex = np.floor(rng.random(n_ex) * (W - ew))
        ey = np.floor(rng.random(n_ex) * (H - eh))
        g_box[exact_int] = np.stack([ex, ey, ew, eh], 1)

    # equal-IoU twins: integer box A, its twin B shifted by 2s along x or y, a
    # detection halfway (the same IoU with A and B; pycocotools matches the last of
    # equal candidates) and a lower-scored detection equal to A, which can only
    # match A. Which twin the first detection takes changes the result.
    twin = (rng.random(n_g) < equal_iou_fraction) & ~exact
    n_tw = int(twin.sum())
    tw_box = np.zeros((n_tw, 4))
    tw_det1 = np.zeros((n_tw, 4))
    if n_tw:
        W, H = img_w[g_img[twin]], img_h[g_img[twin]]
        along = 4.0 * rng.integers(2, 25, n_tw)  # side along the shift, <= 96
        across = rng.integers(4, 101, n_tw).astype(np.float64)
        shift = rng.integers(1, (along // 4).astype(np.int64) + 1).astype(np.float64)  # s <= side/4
        vertical = rng.random(n_tw) < 0.5
        lim_a = np.where(vertical, H, W) - along - 2 * shift
        lim_c = np.where(vertical, W, H) - across
        pa = np.floor(rng.random(n_tw) * lim_a)
        pc = np.floor(rng.random(n_tw) * lim_c)
        a_box = np.where(
            vertical[:, None],
            np.stack([pc, pa, across, along], 1),
            np.stack([pa, pc, along, across], 1),
        )
        step = np.where(
            vertical[:, None],
            np.stack([0 * shift, shift, 0 * shift, 0 * shift], 1),
            np.stack([shift, 0 * shift, 0 * shift, 0 * shift], 1),
        )
        g_box[twin] = a_box
        tw_box = a_box + 2 * step
        tw_det1 = a_box + step

    # ---------------------------------------------------------- crowd regions
    n_crowd = _count(crowd_fraction, n_g)
    crowd_box = np.zeros((0, 4))
    crowd_img = crowd_cat = np.zeros(0, np.int64)
    member_img = member_cat = np.zeros(0, np.int64)
    member_box = np.zeros((0, 4))
    absorbed_img = absorbed_cat = np.zeros(0, np.int64)
    absorbed_box = np.zeros((0, 4))
    if n_crowd:
        anchor = rng.choice(n_g, n_crowd)
        crowd_img = g_img[anchor]
        crowd_cat = g_cat[anchor]
        aw, ah = g_box[anchor, 2], g_box[anchor, 3]
        cx, cy = g_box[anchor, 0] + aw / 2, g_box[anchor, 1] + ah / 2
        rw = np.maximum(aw * rng.uniform(2.0, 5.0, n_crowd), 40.0)
        rh = np.maximum(ah * rng.uniform(2.0, 5.0, n_crowd), 40.0)
        W, H = img_w[crowd_img], img_h[crowd_img]
        x1 = np.clip(cx - rw / 2, 0, W - 2)
        y1 = np.clip(cy - rh / 2, 0, H - 2)
        x2 = np.clip(cx + rw / 2, x1 + 1, W)
        y2 = np.clip(cy + rh / 2, y1 + 1, H)
        crowd_box = np.stack([x1, y1, x2 - x1, y2 - y1], 1)
        # several annotated objects inside each crowd region
        m = rng.integers(1, 4, n_crowd)
        owner = np.repeat(np.arange(n_crowd), m)
        member_img, member_cat = crowd_img[owner], crowd_cat[owner]
        member_box = _boxes_inside(rng, crowd_box[owner], 0.15, 0.45)
        # detections of unannotated instances, absorbed by the crowd region
        a = rng.integers(2, 7, n_crowd)
        owner = np.repeat(np.arange(n_crowd), a)
        absorbed_img, absorbed_cat = crowd_img[owner], crowd_cat[owner]
        absorbed_box = _boxes_inside(rng, crowd_box[owner], 0.08, 0.4)

    # ----------------------------------------------------- duplicate gt boxes
    n_dup = _count(duplicate_gt_fraction, n_g)
    dup = rng.choice(n_g, n_dup, replace=False) if n_dup else np.zeros(0, np.int64)

    # regular (non-crowd) gts: originals, crowd members, duplicates
    r_img = np.concatenate([g_img, member_img, g_img[dup], g_img[twin]])
    r_cat = np.concatenate([g_cat, member_cat, g_cat[dup], g_cat[twin]])
    r_box = np.concatenate([g_box, member_box, g_box[dup], tw_box])
    r_exact = np.concatenate(
        [exact, np.zeros(len(member_img), bool), exact[dup], np.zeros(n_tw, bool)]
    )
    all_img = np.concatenate([r_img, crowd_img])
    all_cat = np.concatenate([r_cat, crowd_cat])
    all_box = np.concatenate([r_box, crowd_box])
    all_crowd = np.concatenate([np.zeros(len(r_img), np.int64), np.ones(len(crowd_img), np.int64)])
    n_all = len(all_img)
    all_area = all_box[:, 2] * all_box[:, 3] * rng.uniform(area_scale[0], area_scale[1], n_all)
    on_boundary = rng.random(n_all) < boundary_area_fraction
    all_area[on_boundary] = rng.choice([SMALL_AREA, MEDIUM_AREA], int(on_boundary.sum()))

    # ------------------------------------------- detections: jittered copies
    n_r = len(r_img)
    k = 1 + rng.poisson(copies_per_gt, n_r)
    src = np.repeat(np.arange(n_r), k)
    n_j = len(src)
    sigma = rng.choice(
        np.array([0.01, 0.03, 0.06, 0.1, 0.16, 0.25, 0.4]),
        n_j,
        p=[0.12, 0.2, 0.2, 0.18, 0.12, 0.1, 0.08],
    )
    sb = r_box[src]
    jx = sb[:, 0] + rng.normal(0, 1, n_j) * sigma * sb[:, 2]
    jy = sb[:, 1] + rng.normal(0, 1, n_j) * sigma * sb[:, 3]
    jw = sb[:, 2] * np.exp(rng.normal(0, 1, n_j) * sigma)
    jh = sb[:, 3] * np.exp(rng.normal(0, 1, n_j) * sigma)
    j_box = np.stack([jx, jy, jw, jh], 1)
    j_img = r_img[src]
    j_cat = r_cat[src].copy()
    j_score = np.clip(
        np.exp(-3.0 * sigma) * rng.uniform(0.55, 1.0, n_j) + rng.normal(0, 0.05, n_j), 0.001, 1.0
    )
    wrong = rng.random(n_j) < wrong_category_fraction
    if len(det_cats) > 1 and wrong.any():
        j_cat[wrong] = rng.choice(det_cats, int(wrong.sum()))
        j_score[wrong] *= rng.uniform(0.3, 0.9, int(wrong.sum()))
    jsnap = rng.random(n_j) < snap_fraction
    j_box[jsnap] = np.round(j_box[jsnap])
    j_box[:, 2:] = np.maximum(j_box[:, 2:], 0.5)

    # threshold-IoU detections: the gt box with its width or height cut to
    # (10+j)/20 of it (from either side) -> IoU == thresholds[j] (up to rounding)
    ex_src = np.flatnonzero(r_exact)
    n_es = len(ex_src)
    e_box = r_box[ex_src].copy()
    axis = rng.integers(0, 2, n_es)  # 0: cut width, 1: cut height
    rows = np.arange(n_es)
    full = e_box[rows, 2 + axis]
    e_box[rows, 2 + axis] = full * rng.integers(10, 20, n_es) / 20.0
    flip = rng.random(n_es) < 0.5  # cut the start instead of the end
    e_box[rows[flip], axis[flip]] += full[flip] - e_box[rows[flip], 2 + axis[flip]]
    e_img, e_cat = r_img[ex_src], r_cat[ex_src]
    e_score = rng.uniform(0.3, 1.0, n_es)

    # equal-IoU twin detections: halfway box first, then the box of A
    t_img = np.concatenate([g_img[twin], g_img[twin]])
    t_cat = np.concatenate([g_cat[twin], g_cat[twin]])
    t_box = np.concatenate([tw_det1, g_box[twin]])
    t_s1 = rng.uniform(0.6, 1.0, n_tw)
    t_score = np.concatenate([t_s1, t_s1 * rng.uniform(0.5, 0.99, n_tw)])

    # crowd-absorbed detections
    a_score = rng.uniform(0.1, 0.95, len(absorbed_img))

    # ------------------------------------------ detections: background boxes
    per_img_gtdets = (
        np.bincount(j_img, minlength=n_img)
        + np.bincount(e_img, minlength=n_img)
        + np.bincount(t_img, minlength=n_img)
    )
    target = np.full(n_img, int(dets_per_image))
    fewer = rng.random(n_img) < 0.3
    target[fewer] = rng.integers(0, max(int(dets_per_image), 1), int(fewer.sum()))
    target[blank] = 0
    n_bg = np.maximum(target - per_img_gtdets, 0)
    n_bg[blank] = 0
    b_img = np.repeat(np.arange(n_img), n_bg)
    n_b = len(b_img)
    bw, bh = _sample_sizes(rng, n_b, img_w[b_img], img_h[b_img], lo=4.0, hi=500.0)
    bx, by = _place(rng, bw, bh, img_w[b_img], img_h[b_img])
    b_box = np.stack([bx, by, bw, bh], 1)
    bsnap = rng.random(n_b) < snap_fraction
    b_box[bsnap] = np.maximum(np.round(b_box[bsnap]), [0, 0, 1, 1])
    bnd = rng.random(n_b) < boundary_area_fraction
    side = rng.choice([32.0, 96.0], int(bnd.sum()))
    b_box[bnd, 2] = side
    b_box[bnd, 3] = side
    b_cat = rng.choice(det_cats, n_b) if n_b else np.zeros(0, np.int64)
    b_score = np.clip(rng.beta(0.8, 4.0, n_b), 0.001, 1.0)

    # --------------------------------------- big (image, category) groups
    n_big = _count(big_group_fraction, len(nonempty_idx))
    big_img_list, big_cat_list, big_box_list, big_score_list = [], [], [], []
    if n_big:
        # anchor gt of each chosen image (first gt of the image in generation order)
        big_imgs = rng.choice(nonempty_idx, n_big, replace=False)
        first_gt = np.searchsorted(g_img, big_imgs)
        anc = first_gt + (rng.random(n_big) * gt_count[big_imgs]).astype(np.int64)
        extra = rng.integers(101, 161, n_big)
        owner = np.repeat(np.arange(n_big), extra)
        n_e = len(owner)
        o_img = big_imgs[owner]
        o_cat = g_cat[anc][owner]
        ab = g_box[anc][owner]
        # ~15% jittered copies of the anchor gt, rest random boxes; uniform scores so
        # that true positives also rank beyond the 100-detection cut-off
        is_copy = rng.random(n_e) < 0.15
        s = rng.choice([0.02, 0.05, 0.1, 0.2], n_e)
        cxw = np.stack(
            [
                ab[:, 0] + rng.normal(0, 1, n_e) * s * ab[:, 2],
                ab[:, 1] + rng.normal(0, 1, n_e) * s * ab[:, 3],
                ab[:, 2] * np.exp(rng.normal(0, 1, n_e) * s),
                ab[:, 3] * np.exp(rng.normal(0, 1, n_e) * s),
            ],
            1,
        )
        rw_, rh_ = _sample_sizes(rng, n_e, img_w[o_img], img_h[o_img], lo=4.0, hi=400.0)
        rx_, ry_ = _place(rng, rw_, rh_, img_w[o_img], img_h[o_img])
        o_box = np.where(is_copy[:, None], cxw, np.stack([rx_, ry_, rw_, rh_], 1))
        o_box[:, 2:] = np.maximum(o_box[:, 2:], 0.5)
        big_img_list.append(o_img)
        big_cat_list.append(o_cat)
        big_box_list.append(o_box)
        big_score_list.append(rng.uniform(0.001, 1.0, n_e))

    # ------------------------------------------------------ all detections
    d_img = np.concatenate([j_img, e_img, t_img, absorbed_img, b_img, *big_img_list]).astype(
        np.int64
    )
    d_cat = np.concatenate([j_cat, e_cat, t_cat, absorbed_cat, b_cat, *big_cat_list]).astype(
        np.int64
    )
    d_box = np.concatenate([j_box, e_box, t_box, absorbed_box, b_box, *big_box_list]).astype(
        np.float64
    )
    d_score = np.concatenate([j_score, e_score, t_score, a_score, b_score, *big_score_list]).astype(
        np.float64
    )
    n_d = len(d_img)

    tie = rng.random(n_d) < tie_fraction
    d_score[tie] = np.maximum(np.round(d_score[tie], tie_decimals), 10.0**-tie_decimals)

    n_dd = _count(duplicate_det_fraction, n_d)
    if n_dd:
        dd = rng.choice(n_d, n_dd, replace=False)
        d_img = np.concatenate([d_img, d_img[dd]])
        d_cat = np.concatenate([d_cat, d_cat[dd]])
        d_box = np.concatenate([d_box, d_box[dd]])
        d_score = np.concatenate([d_score, d_score[dd]])
        n_d = len(d_img)
    d_box[:, 2:] = np.maximum(d_box[:, 2:], 0.5)

    # ------------------------------------------------------------ assemble
    img_order = rng.permutation(n_img) if shuffle else np.argsort(image_ids)
    images = [
        {"id": i, "width": w_, "height": h_, "file_name": f"{i:012d}.jpg"}
        for i, w_, h_ in zip(
            image_ids[img_order].tolist(),
            img_w[img_order].astype(int).tolist(),
            img_h[img_order].astype(int).tolist(),
        )
    ]
    cat_order = rng.permutation(n_cat) if shuffle else np.arange(n_cat)
    categories = [
        {"id": c, "name": f"category_{c}", "supercategory": "thing"}
        for c in cat_ids[cat_order].tolist()
    ]
    ann_order = rng.permutation(n_all) if shuffle else np.arange(n_all)
    annotations = [
        {"id": k_ + 1, "image_id": i, "category_id": c, "bbox": b, "area": a_, "iscrowd": z}
        for k_, (i, c, b, a_, z) in enumerate(
            zip(
                image_ids[all_img[ann_order]].tolist(),
                all_cat[ann_order].tolist(),
                all_box[ann_order].tolist(),
                all_area[ann_order].tolist(),
                all_crowd[ann_order].tolist(),
            )
        )
    ]
    det_order = rng.permutation(n_d) if shuffle else np.arange(n_d)
    detections = [
        {"image_id": i, "category_id": c, "bbox": b, "score": s_}
        for i, c, b, s_ in zip(
            image_ids[d_img[det_order]].tolist(),
            d_cat[det_order].tolist(),
            d_box[det_order].tolist(),
            d_score[det_order].tolist(),
        )
    ]
    gt = {
        "info": {"description": f"ood_jax.testing.coco_cases.random_case(seed={seed})"},
        "licenses": [],
        "images": images,
        "categories": categories,
        "annotations": annotations,
    }
    return gt, detections


def val2017_like(seed: int = 0, num_images: int = 5000) -> tuple[dict, list[dict]]:
    """A case the size of COCO val2017: 5000 images, 80 categories, ~7 gt and
    100 detections per image (~36k annotations, ~0.5M detections)."""
    return random_case(
        seed,
        num_images=num_images,
        num_categories=80,
        gt_per_image=7,
        dets_per_image=100,
    )


def case_summary(gt: dict, detections: list[dict]) -> dict:
    """Counts of the adversarial features present in a case (for tests/demos)."""
    anns = gt["annotations"]
    gt_cat_ids = {a["category_id"] for a in anns}
    det_cat_ids = {d["category_id"] for d in detections}
    all_cat_ids = [c["id"] for c in gt["categories"]]
    img_ids = [im["id"] for im in gt["images"]]
    gt_img_ids = {a["image_id"] for a in anns}
    groups: dict = {}
    for d in detections:
        key = (d["image_id"], d["category_id"])
        groups[key] = groups.get(key, 0) + 1
    scores = np.array([d["score"] for d in detections], np.float64)
    _, counts = np.unique(scores, return_counts=True) if len(scores) else (None, np.zeros(0, int))
    areas = np.array([a["area"] for a in anns], np.float64)
    wh = np.array([a["bbox"][2] * a["bbox"][3] for a in anns], np.float64)

    def _rng(v):
        return np.where(v < SMALL_AREA, 0, np.where(v <= MEDIUM_AREA, 1, 2))

    return {
        "images": len(img_ids),
        "annotations": len(anns),
        "detections": len(detections),
        "crowd": sum(int(a["iscrowd"]) for a in anns),
        "images_without_gt": len(set(img_ids) - gt_img_ids),
        "images_without_gt_or_dets": len(
            set(img_ids) - gt_img_ids - {d["image_id"] for d in detections}
        ),
        "categories_without_gt": len(set(all_cat_ids) - gt_cat_ids),
        "categories_without_gt_with_dets": len((set(all_cat_ids) - gt_cat_ids) & det_cat_ids),
        "groups_over_100": sum(1 for v in groups.values() if v > 100),
        "tied_scores": int(counts[counts > 1].sum()),
        "area_ne_wh": int(np.sum(areas != wh)),
        "area_range_differs_from_box": int(np.sum(_rng(areas) != _rng(wh))),
        "area_on_threshold": int(np.sum((areas == SMALL_AREA) | (areas == MEDIUM_AREA))),
        "image_ids_sorted": img_ids == sorted(img_ids),
        "category_ids_contiguous": sorted(all_cat_ids) == list(range(1, len(all_cat_ids) + 1)),
        "category_ids_sorted": all_cat_ids == sorted(all_cat_ids),
    }
