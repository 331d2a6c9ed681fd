#!/usr/bin/python3
"""Writes segnet's bundled sample segmentation data set (data/train, data/val).

The images are synthetic 64x64 RGB scenes: a few flat-coloured objects on a
varied background. Each mask is a 64x64 8-bit greyscale PNG whose pixel value
is the class index, with the same file stem as its image
(images/0007.png <-> masks/0007.png).

Classes
  0  not annotated (training masks only; train with class weight 0)
  1  background: a linear gradient between two random colours, a faint
     low-frequency wave pattern and mild per-pixel noise
  2  ellipses (disks included), any orientation
  3  rectangles (squares included), rotated by up to +-20 degrees

Objects of both classes take their colour from the same distribution (any RGB
colour at least 80 away from the background under it, plus a light shading
ramp), so only shape separates class 2 from class 3. Each image holds 1-4
objects (with probability 10/20/30/40%) whose extents (ellipse axes, rectangle
sides) are 12-28 px with aspect ratio up to 1.67. Objects never overlap (they
are kept at least 2 px apart) and may run off the image border (at least 58 px
of each stays visible). Images are rendered with 4x4 supersampling, so object
edges are anti-aliased; the mask labels each pixel by its centre.

Annotation scheme
  train: partial, like hand annotation. Every pixel within 1 px of a class
         boundary (a 2 px wide band along each object outline) is 0, and so
         are 0-3 random unannotated ellipses or rectangles of 6-20 px (which
         may hide a whole object). About 12% of training pixels are 0.
  val:   full; every pixel is 1, 2 or 3.

Sizes: 480 training and 80 validation image/mask pairs, about 4 MB in all.
Pixel fractions: train 0/1/2/3 = 12/76/5/7%, val 1/2/3 = 84/7/8%.

Regenerate (from the repository root; needs numpy and PIL):
    ref/make_data.py
The output is deterministic (fixed seed): running it twice writes
byte-identical files. It deletes the *.png files already in the four folders
it writes, and touches nothing else under data/.
"""
import os
import sys

import numpy as np
from PIL import Image

SIZE = 64           # image side, px
SS = 4              # supersampling factor for the rendered image
N_TRAIN = 480
N_VAL = 80
SEED = 20240607
OBJ_MIN, OBJ_MAX = 12, 28     # object extent (diameter / side), px
GAP = 2                       # minimum distance between objects, px
MIN_CONTRAST = 80.0           # min RGB distance object colour <-> background


def grid(n, scale):
    """Pixel-centre coordinates (y, x) of an n x n grid, in output pixels."""
    c = (np.arange(n) + 0.5) / scale
    return np.meshgrid(c, c, indexing="ij")


def shape_inside(kind, cy, cx, a, b, theta, yy, xx):
    """Boolean mask of the points (yy, xx) inside an ellipse or rectangle with
    centre (cy, cx), half-extents a (along theta) and b, rotation theta."""
    dy, dx = yy - cy, xx - cx
    c, s = np.cos(theta), np.sin(theta)
    u = c * dx + s * dy
    v = -s * dx + c * dy
    if kind == "ellipse":
        return (u / a) ** 2 + (v / b) ** 2 <= 1.0
    return (np.abs(u) <= a) & (np.abs(v) <= b)


def random_shape(rng, kind):
    """Centre, half-extents and rotation of one object of the given kind."""
    w = rng.uniform(OBJ_MIN, OBJ_MAX)
    h = w * rng.uniform(0.6, 1.0)      # aspect ratio 1 .. 1/0.6
    if rng.random() < 0.5:
        w, h = h, w
    if kind == "ellipse":
        theta = rng.uniform(0, np.pi)
    else:
        theta = np.deg2rad(rng.uniform(-20, 20))
    # let objects run off the border by up to ~30% of their size
    cy = rng.uniform(-0.2 * h, SIZE + 0.2 * h)
    cx = rng.uniform(-0.2 * w, SIZE + 0.2 * w)
    return cy, cx, w / 2, h / 2, theta


def dilate(m, r):
    """Binary dilation of m by a (2r+1) x (2r+1) square."""
    p = np.pad(m, r)
    out = np.zeros_like(m)
    for dy in range(2 * r + 1):
        for dx in range(2 * r + 1):
            out |= p[dy:dy + SIZE, dx:dx + SIZE]
    return out


def background(rng):
    """Float RGB background at the supersampled resolution."""
    n = SIZE * SS
    yy, xx = grid(n, SS)
    c0 = rng.uniform(30, 225, 3)
    c1 = np.clip(c0 + rng.uniform(-90, 90, 3), 0, 255)
    ang = rng.uniform(0, 2 * np.pi)
    t = ((np.cos(ang) * (xx - SIZE / 2) + np.sin(ang) * (yy - SIZE / 2))
         / SIZE + 0.5).clip(0, 1)
    img = c0 + (c1 - c0) * t[..., None]
    # faint low-frequency texture: two random plane waves, per-channel mix
    for _ in range(2):
        k = rng.uniform(0.08, 0.3)
        a = rng.uniform(0, 2 * np.pi)
        ph = rng.uniform(0, 2 * np.pi)
        wave = np.sin(k * (np.cos(a) * xx + np.sin(a) * yy) + ph)
        img += wave[..., None] * rng.uniform(3, 10, 3)
    return img


def make_pair(rng, annotate_partially):
    n = SIZE * SS
    yy_s, xx_s = grid(n, SS)          # supersampled coordinates
    yy, xx = grid(SIZE, 1)            # pixel centres
    img = background(rng)
    label = np.ones((SIZE, SIZE), np.uint8)
    taken = np.zeros((SIZE, SIZE), bool)
    n_obj = rng.choice([1, 2, 3, 4], p=[0.1, 0.2, 0.3, 0.4])
    placed = tries = 0
    while placed < n_obj and tries < 200:
        tries += 1
        kind = "ellipse" if rng.random() < 0.5 else "rect"
        cy, cx, a, b, th = random_shape(rng, kind)
        inside = shape_inside(kind, cy, cx, a, b, th, yy, xx)
        # at least 40% of a nominal object area visible, and apart from others
        if inside.sum() < 0.4 * OBJ_MIN * OBJ_MIN or (dilate(inside, GAP) & taken).any():
            continue
        inside_s = shape_inside(kind, cy, cx, a, b, th, yy_s, xx_s)
        bg_mean = img[inside_s].mean(0)
        while True:                    # same colour law for both classes
            col = rng.uniform(0, 255, 3)
            if np.linalg.norm(col - bg_mean) >= MIN_CONTRAST:
                break
        # light linear shading across the object
        g = rng.uniform(-0.6, 0.6, 2)
        shade = (g[0] * (yy_s - cy) + g[1] * (xx_s - cx))[..., None]
        obj = np.clip(col + shade, 0, 255)
        img = np.where(inside_s[..., None], obj, img)
        label[inside] = 2 if kind == "ellipse" else 3
        taken |= inside
        placed += 1
    # downsample (box filter) and add mild pixel noise
    img = img.reshape(SIZE, SS, SIZE, SS, 3).mean((1, 3))
    img += rng.normal(0, 2.5, img.shape)
    img = np.clip(np.rint(img), 0, 255).astype(np.uint8)

    if annotate_partially:
        # 0 on every pixel whose 3x3 neighbourhood holds another class
        p = np.pad(label, 1, mode="edge")
        edge = np.zeros((SIZE, SIZE), bool)
        for dy in range(3):
            for dx in range(3):
                edge |= p[dy:dy + SIZE, dx:dx + SIZE] != label
        label[edge] = 0
        # plus a few unannotated regions
        for _ in range(rng.integers(0, 4)):
            kind = "ellipse" if rng.random() < 0.5 else "rect"
            s = rng.uniform(6, 20)
            r = s * rng.uniform(0.5, 1.0)
            m = shape_inside(kind, rng.uniform(0, SIZE), rng.uniform(0, SIZE),
                             s / 2, r / 2, rng.uniform(0, np.pi), yy, xx)
            label[m] = 0
    return img, label


def write_split(root, name, count, rng, partial):
    dirs = [os.path.join(root, name, sub) for sub in ("images", "masks")]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            if f.endswith(".png"):
                os.remove(os.path.join(d, f))
    hist = np.zeros(4, np.int64)
    for i in range(count):
        img, label = make_pair(rng, partial)
        stem = "%04d.png" % i
        Image.fromarray(img, "RGB").save(os.path.join(dirs[0], stem), optimize=True)
        Image.fromarray(label, "L").save(os.path.join(dirs[1], stem), optimize=True)
        hist += np.bincount(label.ravel(), minlength=4)
    frac = hist / hist.sum()
    print("%s: %d pairs, class pixel fractions %s" % (
        name, count, " ".join("%d:%.3f" % (c, f) for c, f in enumerate(frac))))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "data"
    rng = np.random.default_rng(SEED)
    write_split(root, "train", N_TRAIN, rng, partial=True)
    write_split(root, "val", N_VAL, rng, partial=False)


if __name__ == "__main__":
    main()
