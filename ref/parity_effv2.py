#!/usr/bin/python3
"""Writes PyTorch reference fixtures for segnet's tiny EfficientNetV2 "effv2-t":
torchvision's EfficientNet with segnet's stage table, one training step's
forward + backward on a fixed batch, for two padding modes:

  data/ref/effv2-t.symmetric.safetensors  PyTorch padding (k-1)/2
  data/ref/effv2-t.same.safetensors       TensorFlow SAME padding

Each file holds (F32, PyTorch layout: conv weights OIHW, linear weights [out,in]):
  <state_dict name>          every state_dict entry but num_batches_tracked,
                             BEFORE the forward pass
  input                      [4,64,64,3] NHWC images, values 0..255
                             (the torch model is fed x/128 - 1, NCHW)
  labels                     [4] class ids as floats
  logits                     [4,5]
  loss                       [] mean cross entropy over the batch
  grad.<parameter name>      d loss / d parameter
  running.<bn>.running_mean  BN running stats AFTER the training-mode forward
  running.<bn>.running_var   (momentum 0.1, unbiased batch variance)

The forward/backward is computed in float64 from float32-representable weights
and inputs, then rounded to float32 for storage, so the fixtures are the exact
answer to the float32 inputs up to the final rounding.

usage: ref/parity_effv2.py [OUT_DIR]      write both fixtures (default data/ref)
       ref/parity_effv2.py --check FILE   parse FILE back, compare with torch
       ref/parity_effv2.py --selftest     SAME-padding sanity check only
"""
import json
import math
import os
import struct
import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig

SEED = 0
BATCH, SIZE, NUM_CLASSES = 4, 64, 5
MODES = ("symmetric", "same")


# ---------------------------------------------------------------- model


def randomize_bn(model):
    """Non-trivial BN affine parameters and running statistics, so that a
    comparison is not blind to swapped gamma/beta or ignored running stats."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + 0.2 * torch.randn_like(m.weight))
                m.bias.copy_(0.2 * torch.randn_like(m.bias))
                m.running_mean.copy_(0.1 * torch.randn_like(m.running_mean))
                m.running_var.copy_(0.5 + torch.rand_like(m.running_var))

def same_pads(in_size, k, s, d=1):
    """TensorFlow SAME: (before, after) padding along one axis."""
    k_eff = (k - 1) * d + 1
    total = max((math.ceil(in_size / s) - 1) * s + k_eff - in_size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """nn.Conv2d with TensorFlow SAME padding. Installed by swapping the class
    of an existing nn.Conv2d, so parameter names and values are untouched."""

    def forward(self, x):
        top, bottom = same_pads(x.shape[-2], self.kernel_size[0], self.stride[0], self.dilation[0])
        left, right = same_pads(x.shape[-1], self.kernel_size[1], self.stride[1], self.dilation[1])
        if top or bottom or left or right:
            x = F.pad(x, (left, right, top, bottom))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def to_same(model):
    for m in model.modules():
        if type(m) is nn.Conv2d:
            m.__class__ = SameConv2d
            m.padding = (0, 0)
    return model


def build_model(mode):
    torch.manual_seed(SEED)
    setting = [
        FusedMBConvConfig(1, 3, 1, 8, 8, 1),
        FusedMBConvConfig(4, 3, 2, 8, 16, 2),
        FusedMBConvConfig(4, 3, 2, 16, 24, 1),
        MBConvConfig(4, 3, 2, 24, 32, 2, 1.0, 1.0),
        MBConvConfig(6, 3, 1, 32, 40, 1, 1.0, 1.0),
        MBConvConfig(6, 3, 2, 40, 48, 1, 1.0, 1.0),
    ]
    model = EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=NUM_CLASSES,
                         norm_layer=partial(nn.BatchNorm2d, eps=1e-3), last_channel=64)
    randomize_bn(model)  # conv/linear: torchvision init
    if mode == "same":
        to_same(model)
    elif mode != "symmetric":
        raise ValueError(mode)
    return model


def make_batch():
    g = torch.Generator().manual_seed(SEED + 1)
    images = (torch.rand(BATCH, 3, SIZE, SIZE, generator=g) * 255).float()  # NCHW, 0..255
    labels = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
    return images, labels


def compute(mode):
    """Returns an ordered dict name -> float32 tensor, and the metadata."""
    model = build_model(mode)
    images, labels = make_batch()
    out = {}
    for k, v in model.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            out[k] = v.detach().clone().float()
    out["input"] = images.permute(0, 2, 3, 1).contiguous()
    out["labels"] = labels.float()

    model = model.double()
    model.train()
    x = images.double() / 128 - 1
    logits = model(x)
    loss = F.cross_entropy(logits, labels)
    loss.backward()

    out["logits"] = logits.detach().float()
    out["loss"] = loss.detach().float().reshape(())
    for k, p in model.named_parameters():
        out["grad." + k] = p.grad.detach().float()
    for k, v in model.state_dict().items():
        if k.endswith("running_mean") or k.endswith("running_var"):
            out["running." + k] = v.detach().float()
    meta = {
        "model": "effv2-t",
        "padding": mode,
        "seed": str(SEED),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "input": "NHWC 0..255; torch model fed (x/128 - 1) NCHW; model.train(); "
                 "loss = mean cross_entropy; computed in float64, stored F32",
    }
    return out, meta


# ---------------------------------------------------------------- safetensors

def write_safetensors(path, tensors, meta):
    header = {"__metadata__": meta}
    blobs = []
    off = 0
    for name, t in tensors.items():
        t = t.detach().to(torch.float32).contiguous()
        data = struct.pack("<%df" % t.numel(), *t.reshape(-1).tolist())
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((-(8 + len(hjson))) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    assert (8 + n) % 8 == 0, "header not padded to 8"
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    data = buf[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    end = 0
    for name, h in header.items():
        assert h["dtype"] == "F32", name
        b, e = h["data_offsets"]
        assert b == end, f"{name}: gap/overlap at {b} (expected {end})"
        numel = math.prod(h["shape"])
        assert e - b == 4 * numel, f"{name}: size mismatch"
        vals = struct.unpack("<%df" % numel, data[b:e])
        tensors[name] = torch.tensor(vals, dtype=torch.float32).reshape(h["shape"])
        end = e
    assert end == len(data), "trailing bytes in data section"
    return tensors, meta


def check_file(path):
    tensors, meta = read_safetensors(path)
    ref, ref_meta = compute(meta["padding"])
    assert meta == ref_meta, (meta, ref_meta)
    assert list(tensors) == list(ref), "tensor names/order differ"
    for k, t in ref.items():
        assert tensors[k].shape == t.shape, (k, tensors[k].shape, t.shape)
        assert torch.equal(tensors[k], t), f"{k}: values differ"
    print(f"check {path}: OK ({len(tensors)} tensors, bit-identical to torch)")


# ---------------------------------------------------------------- self test

def selftest():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    w = torch.zeros(1, 1, 3, 3)
    w[0, 0, 1] = torch.tensor([1.0, 10.0, 100.0])
    sym = nn.Conv2d(1, 1, 3, stride=2, padding=1, bias=False)
    with torch.no_grad():
        sym.weight.copy_(w)
    same = to_same(nn.Sequential(nn.Conv2d(1, 1, 3, stride=2, padding=1, bias=False)))[0]
    with torch.no_grad():
        same.weight.copy_(w)
        ys, yt = same(x).reshape(-1).tolist(), sym(x).reshape(-1).tolist()
    print(f"selftest: SAME {ys} (want [321, 43]), symmetric {yt} (want [210, 432])")
    assert ys == [321.0, 43.0] and yt == [210.0, 432.0]
    # names and values unchanged by to_same
    a, b = build_model("symmetric").state_dict(), build_model("same").state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--check"]:
        for p in args[1:]:
            check_file(p)
        return
    selftest()
    if args[:1] == ["--selftest"]:
        return
    out_dir = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "ref")
    out_dir = os.path.normpath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    torch.set_printoptions(precision=6)
    for mode in MODES:
        tensors, meta = compute(mode)
        path = os.path.join(out_dir, f"effv2-t.{mode}.safetensors")
        write_safetensors(path, tensors, meta)
        print(f"{path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")
        print(f"  logits {tensors['logits'].tolist()}")
        print(f"  loss {tensors['loss'].item():.7f}")
        check_file(path)


if __name__ == "__main__":
    main()
