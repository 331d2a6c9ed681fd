#!/usr/bin/python3
"""The PyTorch side of the loader row of `make bench`: a DataLoader doing the
work segnet's loader does for `segnet bench --loader` with the same options:

- the images of a classification folder (DIR/<class>/*.jpg, classes sorted by
  name, images by name), read in that order and again from the start;
- each decoded with PIL, converted to RGB, resized to --size with PIL's
  bilinear filter, made a float tensor (H,W,3) of 0..255;
- --augment as segnet applies it (tf.image semantics, on x/255): a horizontal
  flip with p = 1/2, brightness + δ, δ ~ U[-D, D), contrast
  (x - mean_c)·f + mean_c, f ~ U[lo, hi), then ×255;
- batches of --batch images on --workers worker processes, 4 batches ahead
  per worker (prefetch_factor), as segnet's loader keeps 4 ahead.

Timed as segnet times its loader: --warmup batches first (the workers'
start-up), then --steps batches. Prints loader_ms_per_batch and
loader_images_per_s.

usage: ref/bench_loader_torch.py --loader DIR [--size HxW] [--batch B]
           [--workers N] [--augment LIST] [--steps S] [--warmup W]
       ref/bench_loader_torch.py --make-data DIR [--images N] [--size HxW]
The second form writes N JPEGs (quality 90) of HxW into DIR/a and DIR/b:
smooth colour fields with noise, which compress as photographs do.
"""
import argparse
import os
import sys
import time

sys.dont_write_bytecode = True

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402


def parse_size(text):
    h, w = text.lower().split("x")
    return int(h), int(w)


def parse_augment(text):
    aug = {"flip": False, "brightness": 0.0, "contrast": None}
    if text in (None, "", "none"):
        return aug
    for item in text.split(","):
        if item == "flip":
            aug["flip"] = True
        elif item.startswith("brightness="):
            aug["brightness"] = float(item.split("=", 1)[1])
        elif item.startswith("contrast="):
            lo, hi = item.split("=", 1)[1].split(":")
            aug["contrast"] = (float(lo), float(hi))
        else:
            sys.exit("bench_loader_torch.py: --augment item '%s' is not known" % item)
    return aug


class Folder(torch.utils.data.Dataset):
    def __init__(self, root, size, aug, length):
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.items = []
        for label, c in enumerate(classes):
            for name in sorted(os.listdir(os.path.join(root, c))):
                if name.lower().endswith((".jpg", ".jpeg", ".png")):
                    self.items.append((os.path.join(root, c, name), label))
        if not self.items:
            sys.exit("bench_loader_torch.py: no images in %s/<class>/" % root)
        self.size, self.aug, self.length = size, aug, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        path, label = self.items[i % len(self.items)]
        h, w = self.size
        img = Image.open(path).convert("RGB").resize((w, h), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32))  # (H,W,3) 0..255
        g = torch.Generator().manual_seed(i)
        aug = self.aug
        if aug["flip"] and torch.rand(1, generator=g).item() < 0.5:
            x = torch.flip(x, dims=[1])
        if aug["brightness"] > 0 or aug["contrast"]:
            v = x / 255.0
            if aug["brightness"] > 0:
                d = aug["brightness"]
                v = v + (2 * torch.rand(1, generator=g).item() - 1) * d
            if aug["contrast"]:
                lo, hi = aug["contrast"]
                f = lo + (hi - lo) * torch.rand(1, generator=g).item()
                mean = v.mean(dim=(0, 1), keepdim=True)
                v = (v - mean) * f + mean
            x = v * 255.0
        return x, label


def make_data(root, n, size):
    h, w = size
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for k in range(n):
        sub = os.path.join(root, "ab"[k % 2])
        os.makedirs(sub, exist_ok=True)
        a, b, c = rng.uniform(0.002, 0.02, 3)
        base = np.stack([np.sin(a * xx + k), np.cos(b * yy), np.sin(c * (xx + yy))], axis=2)
        img = 127.5 * (base + 1) + rng.normal(0, 12, (h, w, 3))
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
            os.path.join(sub, "img%03d.jpg" % k), quality=90)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loader")
    p.add_argument("--make-data")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--size", default="300x500")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--augment", default="none")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    # the model and threads of the segnet command line: the loader does not use them
    p.add_argument("--model")
    p.add_argument("--classes")
    p.add_argument("--threads")
    args = p.parse_args()
    if args.make_data:
        make_data(args.make_data, args.images, parse_size(args.size))
        return
    total = args.warmup + args.steps
    data = Folder(args.loader, parse_size(args.size), parse_augment(args.augment),
                  total * args.batch)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False,
                                         num_workers=args.workers, prefetch_factor=4)
    t0, images = 0.0, 0
    for got, (x, _) in enumerate(loader):
        if got == args.warmup:
            t0 = time.perf_counter()
        if got >= args.warmup:
            images += x.shape[0]
    seconds = time.perf_counter() - t0
    print("loader_ms_per_batch: %.3f" % (1e3 * seconds / args.steps))
    print("loader_images_per_s: %.2f" % (images / seconds))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
