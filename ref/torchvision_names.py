#!/usr/bin/python3
"""Writes the parameter and BN-buffer names and shapes of torchvision's
EfficientNetV2 models, one `name dim0,dim1,...` line each (PyTorch layout),
so that test_segnet can check segnet's builders name for name.

usage: ref/torchvision_names.py OUT_DIR
"""
import os
import sys

import torchvision.models as tvm


def write_names(model, path, header=None):
    """One `name dim0,dim1,...` line per state_dict entry (num_batches_tracked
    left out), written to a temporary file and renamed over path."""
    with open(path + ".tmp", "w") as f:
        if header:
            f.write(f"# {header}\n")
        for key, t in model.state_dict().items():
            if key.endswith("num_batches_tracked"):
                continue
            f.write(f"{key} {','.join(str(d) for d in t.shape)}\n")
    os.replace(path + ".tmp", path)
    print(path)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "data/ref"
    os.makedirs(out_dir, exist_ok=True)
    for name, build in (("effv2-s", tvm.efficientnet_v2_s), ("effv2-m", tvm.efficientnet_v2_m),
                        ("effv2-l", tvm.efficientnet_v2_l)):
        write_names(build(), os.path.join(out_dir, f"{name}.torchvision.txt"))


if __name__ == "__main__":
    main()
