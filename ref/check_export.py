#!/usr/bin/python3
"""Checks files written by `segnet export` from PyTorch's side.

usage: ref/check_export.py SPEC [SPEC ...]
SPEC: FILE:MODEL:CLASSES:NAMES[:HIDDEN]
  MODEL: effv2-s|m|l or unet-effv2-s|m|l; NAMES: torchvision or timm;
  HIDDEN: the classifier's hidden width (--head-hidden), 0 or absent for none.

torchvision: the file loads with load_state_dict(strict=True) into
torchvision's efficientnet_v2_* (num_classes=CLASSES; with HIDDEN the head
nn.Sequential(Dropout, Linear, ReLU, Dropout, Linear)) or, for unet-effv2-*,
into parity_live.py's UNetEff; every tensor then equals the file's, bit for
bit. timm (not a Debian package): the names and shapes equal timm's
tf_efficientnetv2_* as recorded in data/ref/effv2-*.timm.txt (ref/timm_names.py),
plus the num_batches_tracked buffer timm's batch norms have, which
load_state_dict(strict=True) wants.
Prints one `ok FILE: N tensors` line per SPEC; exits 1 at the first mismatch.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn

sys.dont_write_bytecode = True  # no ref/__pycache__ in the work tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from parity_live import EFF, UNetEff  # noqa: E402

DTYPES = {"F32": ("<f4", 4), "I64": ("<i8", 8)}


def read(path):
    """name -> tensor, for F32 and I64 (what an export holds)."""
    with open(path, "rb") as f:
        buf = f.read()
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = memoryview(buf)[8 + n:]
    out = {}
    for name, h in header.items():
        if h["dtype"] not in DTYPES:
            raise ValueError(f"{path}: {name}: dtype {h['dtype']}")
        np_type, size = DTYPES[h["dtype"]]
        b, e = h["data_offsets"]
        numel = int(np.prod(h["shape"], dtype=np.int64))
        if not (0 <= b <= e <= len(data)) or e - b != size * numel:
            raise ValueError(f"{path}: {name}: bad data_offsets {b},{e} for shape {h['shape']}")
        out[name] = torch.from_numpy(np.frombuffer(data[b:e], dtype=np_type).reshape(h["shape"]).copy())
    return out, meta


def torch_model(model, classes, hidden):
    if model.startswith("unet-effv2-"):
        return UNetEff(model[11:], classes)
    net = EFF[model[6:]](num_classes=classes)
    if hidden:
        features = net.classifier[1].in_features
        net.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2),
                                       nn.Linear(hidden, classes))
    return net


def check_torchvision(path, model, classes, hidden):
    tensors, meta = read(path)
    net = torch_model(model, classes, hidden)
    net.load_state_dict(tensors, strict=True)  # raises on any missing or unexpected name, or a shape
    for name, t in net.state_dict().items():
        if not torch.equal(t, tensors[name].to(t.dtype)):
            raise ValueError(f"{path}: {name} differs after loading")
    if meta.get("padding") not in ("same", "symmetric"):
        raise ValueError(f"{path}: metadata padding {meta.get('padding')!r}")
    return len(tensors)


def check_timm(path, model, classes):
    tensors, _ = read(path)
    want = {}
    with open(os.path.join(HERE, "..", "data", "ref", f"{model}.timm.txt")) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            name, dims = line.split()
            shape = [int(d) for d in dims.split(",")] if dims else []
            if name.startswith("classifier."):
                shape[0] = classes
            want[name] = shape
            if name.endswith(".running_var"):
                want[name[:-len("running_var")] + "num_batches_tracked"] = []
    got = {name: list(t.shape) for name, t in tensors.items()}
    if got != want:
        missing = sorted(set(want) - set(got))[:5]
        extra = sorted(set(got) - set(want))[:5]
        shapes = [n for n in set(got) & set(want) if got[n] != want[n]][:5]
        raise ValueError(f"{path}: not timm's names: missing {missing}, unexpected {extra}, shapes differ {shapes}")
    return len(tensors)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for spec in sys.argv[1:]:
        parts = spec.split(":")
        path, model, classes, names = parts[0], parts[1], int(parts[2]), parts[3]
        hidden = int(parts[4]) if len(parts) > 4 else 0
        try:
            n = check_timm(path, model, classes) if names == "timm" else check_torchvision(path, model, classes, hidden)
        except (ValueError, RuntimeError, KeyError) as e:
            print(f"FAIL {path}: {e}")
            sys.exit(1)
        print(f"ok {path}: {n} tensors")


if __name__ == "__main__":
    main()
