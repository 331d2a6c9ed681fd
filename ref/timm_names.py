#!/usr/bin/python3
"""Writes the parameter and BN-buffer names and shapes of timm's TensorFlow-ported
EfficientNetV2 (tf_efficientnetv2_s/m/l), one `name dim0,dim1,...` line each,
so that test_segnet can check the timm names segnet accepts when loading.

timm is not a Debian package; the fixtures were made once in a throwaway venv:
  /usr/bin/python3 -m venv --system-site-packages /tmp/tvenv
  /tmp/tvenv/bin/pip install --no-deps timm==0.9.16 huggingface_hub pyyaml
  /tmp/tvenv/bin/python ref/timm_names.py data/ref
"""
import os
import sys

import timm

from torchvision_names import write_names  # ref/ is the script's folder


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "data/ref"
    os.makedirs(out_dir, exist_ok=True)
    for name in ("s", "m", "l"):
        model = timm.create_model(f"tf_efficientnetv2_{name}", pretrained=False)
        write_names(model, os.path.join(out_dir, f"effv2-{name}.timm.txt"),
                    f"timm {timm.__version__} tf_efficientnetv2_{name}")


if __name__ == "__main__":
    main()
