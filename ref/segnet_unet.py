#!/usr/bin/python3
"""segnet's plain `unet` as a PyTorch module, for the weights `segnet export` writes.

    import sys; sys.path.insert(0, "ref")
    from segnet_unet import SegnetUNet
    net = SegnetUNet(classes=4, depth=3, width=16)   # the run's --classes, --depth, --width
    net.load_state_dict(state_dict, strict=True)     # segnet export's file, read as tensors

The network is segnet.c's unet_build: level i (0..depth) has width·2^i channels, each a
"double conv" (3×3 conv without bias, padding 1 → BatchNorm2d(eps=1e-5) → ReLU, twice);
depth 2×2 max-pools on the way down; on the way up a nearest-neighbour 2× upsampling,
concatenated (upsampled channels first) with the encoder level of the same size, then a
double conv; a 1×1 conv with bias gives the class logits. The input is what segnet feeds
its models: RGB 0..255 as x/128 - 1, N×3×H×W, H and W multiples of 2^depth.

usage: ref/segnet_unet.py FILE CLASSES DEPTH WIDTH IMAGES_DIR MASKS_DIR PROBS_DIR
  The check `make test` runs (parity_live_unet_export): FILE, a `segnet export` of a unet
  run, loads with load_state_dict(strict=True); for each IMAGES_DIR/<stem>.png (at the
  run's --size) the argmax equals segnet predict's MASKS_DIR/<stem>.png wherever the two
  largest probabilities differ by more than 1e-3, and the softmax is within 1e-3 of the
  fp16 probabilities of PROBS_DIR/<stem>_probs.safetensors (segnet predict --probs).
  Prints `ok N images, max |dp| D`; exits 1 at the first mismatch.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

BN_EPS = 1e-5  # segnet.h's BN_EPS_UNET


def conv_bn_relu(cin, cout):
    # names as segnet's: P.0 the conv, P.1 the batch norm (the ReLU has no tensors)
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout, eps=BN_EPS), nn.ReLU())


class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = conv_bn_relu(cin, cout)
        self.conv2 = conv_bn_relu(cout, cout)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class SegnetUNet(nn.Module):
    """segnet's `unet --depth D --width W` with K classes: enc0..encD, decD-1..dec0, head."""

    def __init__(self, classes, depth=4, width=32):
        super().__init__()
        self.depth = depth
        channels = [width << i for i in range(depth + 1)]
        for i in range(depth + 1):
            self.add_module(f"enc{i}", DoubleConv(3 if i == 0 else channels[i - 1], channels[i]))
        for i in reversed(range(depth)):
            self.add_module(f"dec{i}", DoubleConv(channels[i + 1] + channels[i], channels[i]))
        self.head = nn.Conv2d(channels[0], classes, 1)

    def forward(self, x):
        levels = []
        for i in range(self.depth + 1):
            if i > 0:
                x = F.max_pool2d(x, 2)
            x = getattr(self, f"enc{i}")(x)
            levels.append(x)
        for i in reversed(range(self.depth)):
            up = F.interpolate(x, scale_factor=2, mode="nearest")
            x = getattr(self, f"dec{i}")(torch.cat([up, levels[i]], dim=1))
        return self.head(x)


def check(path, classes, depth, width, images, masks, probs):
    sys.dont_write_bytecode = True  # no ref/__pycache__ in the work tree
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_export import read  # a strict safetensors reader (F32, I64)
    state, _ = read(path)
    net = SegnetUNet(classes, depth, width).eval()
    net.load_state_dict(state, strict=True)
    return compare(net, images, masks, probs)


def compare(net, images, masks, probs):
    """net (in eval mode) against segnet predict's masks and --probs on IMAGES_DIR's PNGs:
    0, or 1 after a line on stderr naming the first image that differs."""
    import torchvision.io as tio
    worst, n = 0.0, 0
    for name in sorted(os.listdir(images)):
        stem, ext = os.path.splitext(name)
        if ext != ".png":
            continue
        rgb = tio.read_image(os.path.join(images, name), tio.ImageReadMode.RGB).float()
        with torch.no_grad():
            p = torch.softmax(net(rgb[None] / 128.0 - 1.0), dim=1)[0]  # K×H×W
        mask = tio.read_image(os.path.join(masks, stem + ".png"))[0].long()
        top2 = p.topk(2, dim=0).values
        clear = (top2[0] - top2[1]) > 1e-3
        wrong = (p.argmax(dim=0) != mask) & clear
        if wrong.any():
            print(f"{stem}: the argmax differs from segnet predict's mask at "
                  f"{int(wrong.sum())} pixels", file=sys.stderr)
            return 1
        theirs = read_probs(os.path.join(probs, stem + "_probs.safetensors")).permute(2, 0, 1)
        d = float((p - theirs).abs().max())
        worst = max(worst, d)
        if not d <= 1e-3:
            print(f"{stem}: max |p - segnet's probabilities| {d:.3g} (want <= 1e-3)", file=sys.stderr)
            return 1
        n += 1
    if n == 0:
        print(f"{images}: no PNG images", file=sys.stderr)
        return 1
    print(f"ok {n} images, max |dp| {worst:.3g}")
    return 0


def read_probs(path):
    """The one fp16 tensor `probs` (H,W,K) that segnet predict --probs writes."""
    with open(path, "rb") as f:
        buf = f.read()
    n = int.from_bytes(buf[:8], "little")
    h = json.loads(buf[8:8 + n].decode("utf-8"))["probs"]
    if h["dtype"] != "F16":
        raise ValueError(f"{path}: probs is {h['dtype']}, want F16")
    b, e = h["data_offsets"]
    a = np.frombuffer(buf[8 + n + b:8 + n + e], dtype="<f2").reshape(h["shape"])
    return torch.from_numpy(a.astype(np.float32))


if __name__ == "__main__":
    if len(sys.argv) != 8:
        sys.exit(__doc__.split("usage: ")[1].split("\n")[0])
    f, k, d, w, images, masks, probs = sys.argv[1:]
    sys.exit(check(f, int(k), int(d), int(w), images, masks, probs))
