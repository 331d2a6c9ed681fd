#!/usr/bin/python3
"""Learnability check for the bundled data set (data/train, data/val).

Trains, in PyTorch on the CPU, the U-Net that segnet's quickstart trains:
model unet, depth 3, base width 16, 4 classes, 64x64 inputs, batch 8,
Adam lr 1e-3 eps 1e-7, cross-entropy weighted by class (0,1,1,1) and averaged
as sum(w*nll)/sum(w). No augmentation. Conv weights keep PyTorch's default
init unless --he is given (He-normal, fan_out, as segnet inits). Per epoch it prints the train loss,
the val loss, the val mean IoU over classes 1..3 (from one confusion matrix
over the whole val set) with the per-class IoUs, and the seconds taken.

usage: ref/check_data_torch.py [--epochs 25] [--threads 2] [--seed 0] [--he]
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

CLASSES, DEPTH, WIDTH, BATCH = 4, 3, 16, 8
WEIGHTS = torch.tensor([0.0, 1.0, 1.0, 1.0])


def load(split):
    names = sorted(glob.glob(os.path.join("data", split, "images", "*.png")))
    x = np.stack([np.asarray(Image.open(n).convert("RGB")) for n in names])
    y = np.stack([np.asarray(Image.open(n.replace("/images/", "/masks/"))) for n in names])
    x = torch.from_numpy(x).permute(0, 3, 1, 2).float()     # NCHW, 0..255
    return x, torch.from_numpy(y).long()


def conv_bn_relu(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1), nn.ReLU(inplace=True)]


class UNet(nn.Module):
    def __init__(self, depth=DEPTH, width=WIDTH, classes=CLASSES):
        super().__init__()
        ch = [width << i for i in range(depth + 1)]
        self.enc = nn.ModuleList()
        for i in range(depth + 1):
            cin = 3 if i == 0 else ch[i - 1]
            pool = [nn.MaxPool2d(2)] if i > 0 else []
            self.enc.append(nn.Sequential(*pool, *conv_bn_relu(cin, ch[i]), *conv_bn_relu(ch[i], ch[i])))
        self.dec = nn.ModuleList()
        for i in range(depth - 1, -1, -1):
            self.dec.append(nn.Sequential(*conv_bn_relu(ch[i + 1] + ch[i], ch[i]), *conv_bn_relu(ch[i], ch[i])))
        self.head = nn.Conv2d(ch[0], classes, 1, bias=True)

    def forward(self, x):
        x = x / 128.0 - 1.0
        skips = []
        for e in self.enc:
            x = e(x)
            skips.append(x)
        for d, skip in zip(self.dec, reversed(skips[:-1])):
            x = d(torch.cat([F.interpolate(x, scale_factor=2, mode="nearest"), skip], 1))
        return self.head(x)


def evaluate(model, x, y):
    model.eval()
    conf = torch.zeros(CLASSES, CLASSES, dtype=torch.long)
    loss_sum = w_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(x), 32):
            logits = model(x[i:i + 32])
            t = y[i:i + 32]
            nll = F.cross_entropy(logits, t, reduction="none")
            w = WEIGHTS[t]
            loss_sum += float((w * nll).sum())
            w_sum += float(w.sum())
            conf += torch.bincount(t.flatten() * CLASSES + logits.argmax(1).flatten(),
                                   minlength=CLASSES * CLASSES).view(CLASSES, CLASSES)
    conf = conf[1:, 1:].double()            # true class 0 not counted; class 0 excluded
    tp = conf.diag()
    iou = tp / (conf.sum(0) + conf.sum(1) - tp)
    return loss_sum / w_sum, iou


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--he", action="store_true", help="He-normal fan_out conv init")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    xt, yt = load("train")
    xv, yv = load("val")
    print("train %d, val %d images" % (len(xt), len(xv)))
    model = UNet()
    if args.he:
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    crit = nn.CrossEntropyLoss(weight=WEIGHTS)   # mean = sum(w*nll)/sum(w)
    print("epoch  train_loss  val_loss  val_mIoU  IoU1   IoU2   IoU3   sec")
    for ep in range(1, args.epochs + 1):
        t0 = time.time()
        model.train()
        perm = torch.randperm(len(xt))
        tot = 0.0
        for i in range(0, len(xt), BATCH):
            idx = perm[i:i + BATCH]
            loss = crit(model(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += float(loss) * len(idx)
        vloss, iou = evaluate(model, xv, yv)
        print("%5d  %10.4f  %8.4f  %8.4f  %.3f  %.3f  %.3f  %5.1f" % (
            ep, tot / len(xt), vloss, float(iou.mean()), *iou.tolist(), time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
