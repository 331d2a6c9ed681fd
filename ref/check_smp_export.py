#!/usr/bin/python3
"""A `segnet export --names smp` file in segmentation_models_pytorch's Unet.

usage: check_smp_export.py FILE SIZE CLASSES IMAGES_DIR MASKS_DIR PROBS_DIR
  FILE, the export of a unet-effv2-SIZE run trained with --bottleneck stage --padding same,
  loads with load_state_dict(strict=True) into
      smp.Unet(encoder_name="tu-tf_efficientnetv2_SIZE", encoder_weights=None, classes=CLASSES)
  and, fed each IMAGES_DIR/<stem>.png as x/128 - 1 (segnet's input scaling), gives segnet
  predict's mask and probabilities (ref/segnet_unet.py's compare: the argmax wherever the top
  two differ by more than 1e-3, the softmax within 1e-3 of the fp16 --probs).
  Prints `ok N images, max |dp| D`. smp and timm are not Debian packages: run it with the
  python of a venv that has segmentation-models-pytorch 0.6 (make test's parity_live_smp_export
  makes one).
"""
import os
import sys


def main(path, size, classes, images, masks, probs):
    sys.dont_write_bytecode = True  # no ref/__pycache__ in the work tree
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import segmentation_models_pytorch as smp
    from check_export import read  # a strict safetensors reader (F32, I64)
    from segnet_unet import compare
    state, _ = read(path)
    net = smp.Unet(encoder_name=f"tu-tf_efficientnetv2_{size}", encoder_weights=None,
                   classes=classes).eval()
    net.load_state_dict(state, strict=True)
    return compare(net, images, masks, probs)


if __name__ == "__main__":
    if len(sys.argv) != 7:
        sys.exit(__doc__.split("usage: ")[1].split("\n")[0])
    f, size, k, images, masks, probs = sys.argv[1:]
    sys.exit(main(f, size, int(k), images, masks, probs))
