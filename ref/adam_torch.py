#!/usr/bin/python3
"""PyTorch's Adam/AdamW as the reference for segnet's Keras-style Adam.

usage: adam_torch.py IN OUT
IN (little-endian): int32 n, int32 steps, float64 lr, beta1, beta2, eps, weight_decay,
then float32 p0[n] and grads[steps][n]. OUT: float32 p[n] after the steps.

segnet follows Keras (epsilon-hat outside the bias correction); PyTorch puts
eps inside it. The two updates are equal when PyTorch's eps at step t is
eps_keras / sqrt(1 - beta2^t), so this script sets that before every step.
The arithmetic is float64, so the comparison measures segnet's fp32 rounding.
"""
import struct
import sys

import numpy as np
import torch


def main():
    src, dst = sys.argv[1], sys.argv[2]
    raw = open(src, "rb").read()
    n, steps = struct.unpack_from("<ii", raw, 0)
    lr, b1, b2, eps, wd = struct.unpack_from("<5d", raw, 8)
    data = np.frombuffer(raw, dtype="<f4", offset=48)
    p = torch.tensor(data[:n].astype(np.float64), requires_grad=True)
    grads = data[n:n + steps * n].reshape(steps, n).astype(np.float64)
    opt = (torch.optim.AdamW([p], lr=lr, betas=(b1, b2), weight_decay=wd) if wd > 0
           else torch.optim.Adam([p], lr=lr, betas=(b1, b2)))
    for t in range(1, steps + 1):
        opt.param_groups[0]["eps"] = eps / (1.0 - b2 ** t) ** 0.5
        p.grad = torch.tensor(grads[t - 1])
        opt.step()
    open(dst, "wb").write(p.detach().numpy().astype("<f4").tobytes())


if __name__ == "__main__":
    main()
