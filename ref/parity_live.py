#!/usr/bin/python3
"""One training step of a segnet model in PyTorch (float64), on weights and a
batch written by segnet, for live parity checks from the C test.

usage: ref/parity_live.py --model NAME --classes K --padding same|symmetric \\
           --weights W.safetensors --batch B.safetensors --out OUT.safetensors
       ref/parity_live.py --selfcheck [--size S] [--models a,b,...]

NAME: effv2-s|m|l, unet, unet-effv2-s|m|l.
W: every parameter and BN running_mean/running_var, F32, PyTorch layout.
B: input F32 NHWC [N,H,W,3] values 0..255; labels F32 [N] or [N,H,W].
The model is fed x/128 - 1 (NCHW), float64, model.train(), dropout and
stochastic depth off, loss = mean cross entropy (over images or pixels).
OUT (F32): logits ([N,K] or NHWC [N,H,W,K]), loss [], grad.<param> for every
parameter, running.<bn>.running_mean/var after the step.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tvm

sys.dont_write_bytecode = True  # no ref/__pycache__ in the work tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_effv2 import randomize_bn, to_same  # noqa: E402  (TF-SAME Conv2d swap keeps names)

EFF = {"s": tvm.efficientnet_v2_s, "m": tvm.efficientnet_v2_m, "l": tvm.efficientnet_v2_l}
MODELS = ("effv2-s", "effv2-m", "effv2-l", "unet", "unet-effv2-s", "unet-effv2-m", "unet-effv2-l")


# ---------------------------------------------------------------- safetensors (numpy, fast)

def read_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError(f"{path}: too short for safetensors")
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = memoryview(buf)[8 + n:]
    out = {}
    for name, h in header.items():
        if h["dtype"] != "F32":
            raise ValueError(f"{path}: {name}: dtype {h['dtype']}, want F32")
        b, e = h["data_offsets"]
        numel = int(np.prod(h["shape"], dtype=np.int64))
        if not (0 <= b <= e <= len(data)) or e - b != 4 * numel:
            raise ValueError(f"{path}: {name}: bad data_offsets {b},{e} for shape {h['shape']}")
        arr = np.frombuffer(data[b:e], dtype="<f4").reshape(h["shape"]).copy()
        out[name] = torch.from_numpy(arr)
    return out


def write_safetensors(path, tensors, meta=None):
    header = {"__metadata__": meta or {}}
    blobs, off = [], 0
    for name, t in tensors.items():
        b = t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((-(8 + len(hj))) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


# ---------------------------------------------------------------- models

def conv_bn_relu(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout, eps=1e-5),
                         nn.ReLU(inplace=True))


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = conv_bn_relu(cin, cout)
        self.conv2 = conv_bn_relu(cout, cout)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class UNet(nn.Module):
    """Plain U-Net, depth 4, width 32: enc0..enc4, dec3..dec0, 1x1 head."""

    def __init__(self, classes, depth=4, width=32, cin=3):
        super().__init__()
        self.depth = depth
        ch = [width * 2 ** i for i in range(depth + 1)]
        for i in range(depth + 1):
            setattr(self, f"enc{i}", Block(cin if i == 0 else ch[i - 1], ch[i]))
        for i in range(depth - 1, -1, -1):
            setattr(self, f"dec{i}", Block(ch[i + 1] + ch[i], ch[i]))
        self.head = nn.Conv2d(ch[0], classes, 1, bias=True)

    def forward(self, x):
        skips = []
        for i in range(self.depth + 1):
            if i > 0:
                x = F.max_pool2d(x, 2, 2)
            x = getattr(self, f"enc{i}")(x)
            skips.append(x)
        for i in range(self.depth - 1, -1, -1):
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            x = getattr(self, f"dec{i}")(torch.cat([x, skips[i]], 1))
        return self.head(x)


class Decoder(nn.Module):
    def __init__(self, in_chs):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cin, cout) for cin, cout in in_chs)


def entry_info(entry):
    """(stride, out_channels) of one features entry, from its convs."""
    stride, out = 1, None
    for m in entry.modules():
        if isinstance(m, nn.Conv2d):
            stride *= m.stride[0]
    convs = [m for m in entry.modules() if isinstance(m, nn.Conv2d)]
    out = convs[-1].out_channels  # project conv (SE convs come before it)
    return stride, out


class UNetEff(nn.Module):
    """segmentation_models-style Unet on torchvision EfficientNetV2 features."""

    DEC = (256, 128, 64, 32, 16)

    def __init__(self, size, classes):
        super().__init__()
        self.features = EFF[size]().features
        s, stride_ch, last_idx = 1, {}, {}
        for j, entry in enumerate(self.features):
            st, ch = entry_info(entry)
            s *= st
            stride_ch[s] = ch
            last_idx[s] = j
        assert s == 32, s
        self.skip_idx = {st: last_idx[st] for st in (2, 4, 8, 16)}
        prev = stride_ch[32]
        in_chs = []
        for i, cout in enumerate(self.DEC):
            cin = prev + (stride_ch[2 ** (4 - i)] if i < 4 else 0)
            in_chs.append((cin, cout))
            prev = cout
        self.decoder = Decoder(in_chs)
        self.segmentation_head = nn.Sequential(nn.Conv2d(self.DEC[-1], classes, 3, padding=1, bias=True))

    def forward(self, x):
        h_in = x.shape[-2]
        skips = {}
        for entry in self.features:
            x = entry(x)
            if h_in % x.shape[-2]:
                raise ValueError(f"input height {h_in} not divisible by feature height {x.shape[-2]}")
            skips[h_in // x.shape[-2]] = x  # last entry with each stride wins
        if h_in // x.shape[-2] != 32:
            raise ValueError(f"bottleneck stride {h_in // x.shape[-2]}, want 32")
        for i, blk in enumerate(self.decoder.blocks):
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            if i < 4:
                x = torch.cat([x, skips[2 ** (4 - i)]], 1)
            x = blk(x)
        return self.segmentation_head(x)


def build(name, classes, padding):
    if name.startswith("effv2-") and name[6:] in EFF:
        model = EFF[name[6:]](num_classes=classes, stochastic_depth_prob=0.0)
        segmentation = False
    elif name == "unet":
        model, segmentation = UNet(classes), True
    elif name.startswith("unet-effv2-") and name[11:] in EFF:
        model, segmentation = UNetEff(name[11:], classes), True
    else:
        raise ValueError(f"unknown model {name!r} (want one of {', '.join(MODELS)})")
    for m in model.modules():  # dropout / stochastic depth off
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if type(m).__name__ == "StochasticDepth":
            m.p = 0.0
    if padding == "same":
        to_same(model)
    elif padding != "symmetric":
        raise ValueError(f"padding {padding!r}, want same|symmetric")
    return model, segmentation


# ---------------------------------------------------------------- one step

def relu_to_silu(module):
    """Every ReLU becomes SiLU (a smooth model: no activation sits on a kink
    that fp32 and fp64 could put on different sides)."""
    for child_name, child in module.named_children():
        if isinstance(child, nn.ReLU):
            setattr(module, child_name, nn.SiLU())
        else:
            relu_to_silu(child)


def step(name, classes, padding, weights, batch, relu_as_silu=False):
    """weights, batch: dicts of F32 tensors. Returns the output dict."""
    model, seg = build(name, classes, padding)
    if relu_as_silu:
        relu_to_silu(model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad_missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if bad_missing or unexpected:
        raise ValueError(f"weights do not match {name}: missing {bad_missing}, unexpected {list(unexpected)}")
    model = model.double()
    model.train()
    if "input" not in batch or "labels" not in batch:
        raise ValueError(f"batch needs input and labels, has {list(batch)}")
    inp, lab = batch["input"], batch["labels"]
    if inp.dim() != 4 or inp.shape[3] != 3:
        raise ValueError(f"input shape {list(inp.shape)}, want [N,H,W,3]")
    want = [inp.shape[0]] + ([inp.shape[1], inp.shape[2]] if seg else [])
    if list(lab.shape) != want:
        raise ValueError(f"labels shape {list(lab.shape)}, want {want}")
    if not torch.equal(lab, lab.round()) or lab.min() < 0 or lab.max() >= classes:
        raise ValueError(f"labels must be integers in [0,{classes})")
    x = inp.double().permute(0, 3, 1, 2).contiguous() / 128 - 1
    logits = model(x)
    loss = F.cross_entropy(logits, lab.long())
    loss.backward()
    out = {"logits": (logits.permute(0, 2, 3, 1) if seg else logits).detach(),
           "loss": loss.detach().reshape(())}
    for k, p in model.named_parameters():
        out["grad." + k] = p.grad.detach()
    for k, v in model.state_dict().items():
        if k.endswith("running_mean") or k.endswith("running_var"):
            out["running." + k] = v.detach()
    return out


def run(args):
    t0 = time.time()
    weights = read_safetensors(args.weights)
    batch = read_safetensors(args.batch)
    out = step(args.model, args.classes, args.padding, weights, batch, args.relu_as_silu)
    write_safetensors(args.out, out, {"model": args.model, "padding": args.padding})
    loss = out["loss"].item()
    print(f"{args.model} loss {loss:.9g} elapsed {time.time() - t0:.2f}s", flush=True)
    return out


# ---------------------------------------------------------------- self check

def selfcheck(size, names):
    torch.manual_seed(0)
    K, N = 3, 2
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            for padding in ("symmetric", "same"):
                model, seg = build(name, K, padding)
                randomize_bn(model)
                sd = {k: v.float() for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
                w = os.path.join(d, "w.safetensors")
                b = os.path.join(d, "b.safetensors")
                o = os.path.join(d, "o.safetensors")
                write_safetensors(w, sd)
                lab_shape = (N, size, size) if seg else (N,)
                write_safetensors(b, {"input": (torch.rand(N, size, size, 3) * 255).float(),
                                      "labels": torch.randint(0, K, lab_shape).float()})
                args = argparse.Namespace(model=name, classes=K, padding=padding, weights=w, batch=b, out=o)
                run(args)
                res = read_safetensors(o)
                params = dict(model.named_parameters())
                bufs = [k for k in sd if k.endswith("running_mean") or k.endswith("running_var")]
                want = {"logits": [N, size, size, K] if seg else [N, K], "loss": []}
                want.update({"grad." + k: list(p.shape) for k, p in params.items()})
                want.update({"running." + k: list(sd[k].shape) for k in bufs})
                got = {k: list(v.shape) for k, v in res.items()}
                assert got == want, (set(got) ^ set(want),
                                     [k for k in want if k in got and got[k] != want[k]])
                assert all(torch.isfinite(v).all() for v in res.values()), "non-finite output"
                assert any(res["running." + k].ne(sd[k]).any() for k in bufs), "running stats unchanged"
                print(f"  selfcheck {name} {padding}: {len(sd)} state_dict keys (excl. num_batches_tracked), "
                      f"{len(params)} params, {len(bufs)} BN buffers, {len(res)} outputs, "
                      f"{os.path.getsize(o)} bytes", flush=True)
    print("selfcheck OK")


def main():
    p = argparse.ArgumentParser(description="PyTorch float64 reference step for segnet")
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--classes", type=int)
    p.add_argument("--padding", choices=("same", "symmetric"))
    p.add_argument("--weights")
    p.add_argument("--batch")
    p.add_argument("--out")
    p.add_argument("--relu-as-silu", action="store_true", help="replace every ReLU by SiLU (smooth model)")
    p.add_argument("--selfcheck", action="store_true")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--models", default="effv2-s,unet,unet-effv2-s")
    args = p.parse_args()
    try:
        if args.selfcheck:
            selfcheck(args.size, args.models.split(","))
            return
        missing = [o for o in ("model", "classes", "padding", "weights", "batch", "out") if getattr(args, o) is None]
        if missing:
            p.error("missing " + ", ".join("--" + m for m in missing))
        run(args)
    except Exception as e:  # one clear line, non-zero exit
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        print(f"parity_live: error: {msg}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
