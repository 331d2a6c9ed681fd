#!/usr/bin/python3
"""segmentation_models_pytorch's DiceLoss, JaccardLoss, TverskyLoss and LovaszLoss as
the reference for segnet's region losses (--loss dice|jaccard|tversky|lovasz).

usage: losses_smp.py IN OUT   (run by a python that can import segmentation_models_pytorch:
                               the test makes a venv for it)
IN (little-endian): int32 N, H, W, K, cases; int32 labels[N*H*W] (-1: ignored);
float32 logits[N*H*W*K] (NHWC); then per case int32 kind (0 dice, 1 jaccard,
2 tversky, 3 lovasz: it has no class weights), int32 per_image, float64 smooth, alpha, beta, gamma, weights[K].
OUT: per case float64 loss, then float64 d(loss)/d(logits)[N*H*W*K] (NHWC).

segnet's dice is sm's F1 form (2I + s)/(P + G + s); smp's is (I + s')/((P + G)/2 + s'),
the same score when s' = s/2. Per image: smp's loss of each image, averaged
(segmentation_models' per_image). The arithmetic is float64 with autograd (lovasz: float32).
"""
import struct
import sys

import numpy as np
import torch
from segmentation_models_pytorch.losses import DiceLoss, JaccardLoss, LovaszLoss, TverskyLoss

IGNORE = 255


def main():
    src, dst = sys.argv[1], sys.argv[2]
    raw = open(src, "rb").read()
    n, h, w, k, cases = struct.unpack_from("<5i", raw, 0)
    at = 20
    labels = np.frombuffer(raw, dtype="<i4", count=n * h * w, offset=at).reshape(n, h, w)
    at += 4 * n * h * w
    logits = np.frombuffer(raw, dtype="<f4", count=n * h * w * k, offset=at).reshape(n, h, w, k)
    at += 4 * n * h * w * k
    y = torch.tensor(np.where(labels < 0, IGNORE, labels).astype(np.int64))
    out = open(dst, "wb")
    for _ in range(cases):
        kind, per_image = struct.unpack_from("<2i", raw, at)
        smooth, alpha, beta, gamma = struct.unpack_from("<4d", raw, at + 8)
        weights = list(struct.unpack_from("<%dd" % k, raw, at + 40))
        at += 40 + 8 * k
        common = dict(mode="multiclass", from_logits=True, ignore_index=IGNORE,
                      class_weights=weights)
        if kind == 0:
            loss_fn = DiceLoss(smooth=smooth / 2, **common)
        elif kind == 1:
            loss_fn = JaccardLoss(smooth=smooth, **common)
        elif kind == 3:
            loss_fn = LovaszLoss(mode="multiclass", ignore_index=IGNORE)
        else:
            loss_fn = TverskyLoss(smooth=smooth, alpha=alpha, beta=beta, gamma=gamma, **common)
        # smp's LovaszLoss computes its Jaccard gradient in float32 (and fails on float64)
        dtype = np.float32 if kind == 3 else np.float64
        z = torch.tensor(logits.astype(dtype)).permute(0, 3, 1, 2).contiguous()
        z.requires_grad_(True)
        if per_image:
            loss = sum(loss_fn(z[i:i + 1], y[i:i + 1]) for i in range(n)) / n
        else:
            loss = loss_fn(z, y)
        loss.backward()
        out.write(struct.pack("<d", loss.item()))
        out.write(z.grad.permute(0, 2, 3, 1).contiguous().numpy().astype("<f8").tobytes())
    out.close()


if __name__ == "__main__":
    main()
