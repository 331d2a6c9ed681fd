#!/usr/bin/python3
"""Writes ImageNet EfficientNetV2 weights as safetensors that `segnet train
--weights` (and predict, eval) read, from the framework that has them. Run it
where that framework and the internet are; segnet itself needs neither.

usage: ref/export_pretrained.py --source torchvision|timm|keras --model effv2-s|m|l
           --out FILE.safetensors [--random] [--classes K]

  torchvision  torchvision.models.efficientnet_v2_*(weights='DEFAULT'): names as
               they are (segnet's own); segnet pads symmetrically (torchvision's)
  timm         timm.create_model('tf_efficientnetv2_*', pretrained=True): timm's
               names; segnet pads as TensorFlow ('same')
  keras        keras.applications.EfficientNetV2S/M/L(weights='imagenet',
               include_preprocessing=True): every layer renamed to timm's
               tf_efficientnetv2_* tensor (the same network), kernels from
               Keras' HWIO to PyTorch's OIHW, depthwise (H,W,C,1) to (C,1,H,W),
               batch norm's gamma/beta/moving statistics, the dense kernel
               transposed; Keras' Rescaling(1/128, offset -1) is segnet's own
               x/128 - 1, so nothing else changes.
  --random     the architecture with random weights and random batch-norm
               statistics instead of ImageNet's (what the tests use: no download;
               for a trial of segnet where there is no internet: the file says
               so in its metadata, and segnet train says so when it loads it);
               with --predict, the head scaled so that the probabilities vary
               from image to image
  --classes K  the head's classes (default 1000, ImageNet's)
  --predict B.safetensors --predictions OUT.csv
               also run the framework's own model on the images of B (F32
               [N,H,W,3], values 0..255, fed as x/128 - 1 like segnet; Keras
               rescales them itself) and write `index,p0,...` rows of its
               softmax probabilities (segnet's tests compare segnet predict)

Every BN's num_batches_tracked is written as I64 (segnet skips it on load).
"""
import argparse
import json
import os
import sys

import numpy as np

SIZES = ("s", "m", "l")


def write_safetensors(path, tensors, meta):
    """tensors: name -> numpy array (float32 or int64)."""
    header = {"__metadata__": meta}
    blobs, off = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dtype = {np.dtype("float32"): "F32", np.dtype("int64"): "I64"}[a.dtype]
        b = a.astype("<f4" if dtype == "F32" else "<i8").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((-(8 + len(hj))) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    os.replace(path + ".tmp", path)


def read_batch(path):
    """The F32 [N,H,W,3] tensor named 'images' of a safetensors file."""
    with open(path, "rb") as f:
        buf = f.read()
    n = int.from_bytes(buf[:8], "little")
    h = json.loads(buf[8:8 + n].decode("utf-8"))["images"]
    b, e = h["data_offsets"]
    return np.frombuffer(buf[8 + n + b:8 + n + e], dtype="<f4").reshape(h["shape"]).copy()


def torch_predict(model, images):
    import torch
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(images / 128.0 - 1.0).float().permute(0, 3, 1, 2)
        return torch.softmax(model(x).double(), dim=1).numpy()


def head_for_spread(features, kernel, bias):
    """A random net's features barely depend on its input, so its softmax
    would too: the head (z = f·kernel + bias, kernel (in, out)) is rescaled so
    that the logits vary by about 1 from image to image, around 0."""
    f = features.astype(np.float64)
    z = f @ kernel + bias
    spread = float(np.std(z - z.mean(axis=0, keepdims=True)))
    kernel = kernel / spread
    return kernel, -(f.mean(axis=0) @ kernel)


def calibrate_torch(model, head, images):
    import torch
    seen = []
    hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].double().numpy()))
    model.eval()
    with torch.no_grad():
        model(torch.from_numpy(images / 128.0 - 1.0).float().permute(0, 3, 1, 2))
    hook.remove()
    kernel, bias = head_for_spread(seen[0], head.weight.detach().double().numpy().T, head.bias.detach().double().numpy())
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(kernel.T))
        head.bias.copy_(torch.from_numpy(bias))


# Random weights for the tests. The convolutions and the head as torchvision
# draws them (kaiming normal, fan_out = out_channels·kh·kw, depthwise kernels
# included; a uniform head): timm's and Keras' own draws give depthwise
# kernels a fan_out of kh·kw, and their activations grow without bound. Batch
# norm: random γ and β, running statistics those of the test images, then
# perturbed a little, and a small γ (0.3) at the end of every residual block.
# A random network is otherwise either chaotic (the fp32 and fp64 forwards
# differ by 1e-2) or blind to its input (the images' features agree to 1e-5);
# so built, EfficientNetV2-S's features still vary between the images by 0.8
# of their spread, and fp32 and fp64 agree to 5e-6 in the probabilities.
GAMMA_BLOCK_END = 0.3


def randomize_torch(model, seed, images):
    import torch
    g = torch.Generator().manual_seed(seed)
    blocks = [b for stage in model.blocks for b in stage] if hasattr(model, "blocks") else \
             [b for stage in model.features[1:-1] for b in stage]  # timm, torchvision
    block_end = {id([m for m in b.modules() if isinstance(m, torch.nn.BatchNorm2d)][-1]) for b in blocks}
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1]
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_out) ** 0.5)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.Linear):
                r = 1.0 / m.out_features ** 0.5
                m.weight.copy_((2 * torch.rand(m.weight.shape, generator=g) - 1) * r)
                m.bias.zero_()
        for m in bns:
            scale = GAMMA_BLOCK_END if id(m) in block_end else 1.0
            m.weight.copy_(scale * (1.0 + 0.2 * torch.randn(m.weight.shape, generator=g)))
            m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            m.momentum = 1.0  # running statistics := the images'
        model.train()
        model(torch.from_numpy(images / 128.0 - 1.0).float().permute(0, 3, 1, 2))
        for m in bns:
            m.momentum = 0.1
            m.running_mean.add_(0.05 * m.running_var.sqrt() * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.mul_(0.9 + 0.2 * torch.rand(m.running_var.shape, generator=g))
    model.eval()


def noise_images(seed):
    return np.random.default_rng(seed).integers(0, 256, (2, 64, 64, 3)).astype(np.float32)


def from_torch_model(model):
    return {k: v.detach().cpu().numpy().astype(np.int64 if k.endswith("num_batches_tracked") else np.float32)
            for k, v in model.state_dict().items()}


def torchvision_weights(size, random, classes, images):
    import torchvision.models as tvm
    import torch
    torch.manual_seed(1)
    build = {"s": tvm.efficientnet_v2_s, "m": tvm.efficientnet_v2_m, "l": tvm.efficientnet_v2_l}[size]
    if random:
        model = build(num_classes=classes)
        randomize_torch(model, 1, images)
        calibrate = lambda images: calibrate_torch(model, model.classifier[1], images)
    else:
        calibrate = None
        model = build(weights="DEFAULT")
        if classes != 1000:
            sys.exit("--classes: ImageNet weights have 1000 classes; segnet train replaces the head")
    return (lambda: from_torch_model(model)), "symmetric", lambda images: torch_predict(model, images), calibrate


def timm_weights(size, random, classes, images):
    import timm
    model = timm.create_model(f"tf_efficientnetv2_{size}", pretrained=not random, num_classes=classes)
    if random:
        randomize_torch(model, 1, images)
    calibrate = (lambda images: calibrate_torch(model, model.classifier, images)) if random else None
    return (lambda: from_torch_model(model)), "same", lambda images: torch_predict(model, images), calibrate


# ---------------------------------------------------------------- Keras -> timm names

def keras_block_names(model):
    """[(stage, index, prefix, kind)] for Keras' blocks named block{stage}{letter}_,
    kind: 'cba' (fused, no expansion), 'er' (fused, expanded) or 'ir' (MBConv)."""
    prefixes = {}
    for layer in model.layers:
        n = layer.name
        if n.startswith("block") and "_" in n:
            p = n.split("_")[0] + "_"
            prefixes.setdefault(p, set()).add(n[len(p):])
    blocks = []
    for p, parts in prefixes.items():
        stage, letter = int(p[5:-2]), p[-2]
        kind = "ir" if "dwconv2" in parts else "er" if "expand_conv" in parts else "cba"
        blocks.append((stage - 1, ord(letter) - ord("a"), p, kind))
    return sorted(blocks)


def keras_weights(size, random, classes, images):
    import tensorflow as tf
    build = {"s": tf.keras.applications.EfficientNetV2S, "m": tf.keras.applications.EfficientNetV2M,
             "l": tf.keras.applications.EfficientNetV2L}[size]
    tf.keras.utils.set_random_seed(1)
    model = build(weights=None if random else "imagenet", include_preprocessing=True, classes=classes,
                  input_shape=(64, 64, 3) if random else None)
    if random:
        randomize_keras(model, 1, images)
    predict = lambda images: model(images.astype(np.float32), training=False).numpy()

    def calibrate(images):  # as calibrate_torch
        dense = model.get_layer("predictions")
        features = tf.keras.Model(model.input, dense.input)(images.astype(np.float32), training=False).numpy()
        kernel, bias = head_for_spread(features, *dense.get_weights())
        dense.set_weights([kernel.astype(np.float32), bias.astype(np.float32)])

    return (lambda: keras_to_timm(model)), "same", predict, calibrate if random else None


def randomize_keras(model, seed, images):
    """randomize_torch in Keras' layouts (HWIO kernels, (kh,kw,C,1) depthwise
    kernels, (in,out) dense kernels; a block ends at its project_bn)."""
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    bns = []
    for layer in model.layers:
        w = layer.get_weights()
        if isinstance(layer, tf.keras.layers.DepthwiseConv2D):
            kh, kw, c, _ = w[0].shape
            w[0] = f32(rng.standard_normal(w[0].shape) * (2.0 / (c * kh * kw)) ** 0.5)
        elif isinstance(layer, tf.keras.layers.Conv2D):
            kh, kw, _, out = w[0].shape
            w[0] = f32(rng.standard_normal(w[0].shape) * (2.0 / (out * kh * kw)) ** 0.5)
        elif isinstance(layer, tf.keras.layers.Dense):
            w[0] = f32((2 * rng.random(w[0].shape) - 1) / w[0].shape[1] ** 0.5)
        elif isinstance(layer, tf.keras.layers.BatchNormalization):
            scale = GAMMA_BLOCK_END if layer.name.endswith("project_bn") and layer.name.startswith("block") else 1.0
            w[0] = f32(scale * (1.0 + 0.2 * rng.standard_normal(w[0].shape)))
            w[1] = f32(0.1 * rng.standard_normal(w[1].shape))
            layer.momentum = 0.0  # moving statistics := the images'
            bns.append(layer)
        else:
            continue
        if len(w) > 1 and not isinstance(layer, tf.keras.layers.BatchNormalization):
            w[1] = np.zeros_like(w[1])
        layer.set_weights(w)
    model(images.astype(np.float32), training=True)
    for layer in bns:
        layer.momentum = 0.99
        gamma, beta, mean, var = layer.get_weights()
        mean = mean + 0.05 * np.sqrt(var) * rng.standard_normal(mean.shape)
        var = var * (0.9 + 0.2 * rng.random(var.shape))
        layer.set_weights([gamma, beta, f32(mean), f32(var)])


def keras_to_timm(model):
    out = {}
    layers = {layer.name: layer for layer in model.layers}

    def conv(keras_name, timm_name, depthwise=False):
        w = layers[keras_name].get_weights()
        k = w[0]
        out[timm_name + ".weight"] = k.transpose(2, 3, 0, 1) if depthwise else k.transpose(3, 2, 0, 1)
        if len(w) > 1:
            out[timm_name + ".bias"] = w[1]

    def bn(keras_name, timm_name):
        gamma, beta, mean, var = layers[keras_name].get_weights()
        out[timm_name + ".weight"], out[timm_name + ".bias"] = gamma, beta
        out[timm_name + ".running_mean"], out[timm_name + ".running_var"] = mean, var
        out[timm_name + ".num_batches_tracked"] = np.array(0, dtype=np.int64)

    conv("stem_conv", "conv_stem")
    bn("stem_bn", "bn1")
    for stage, j, p, kind in keras_block_names(model):
        t = f"blocks.{stage}.{j}."
        if kind == "cba":
            conv(p + "project_conv", t + "conv")
            bn(p + "project_bn", t + "bn1")
        elif kind == "er":
            conv(p + "expand_conv", t + "conv_exp")
            bn(p + "expand_bn", t + "bn1")
            conv(p + "project_conv", t + "conv_pwl")
            bn(p + "project_bn", t + "bn2")
        else:
            conv(p + "expand_conv", t + "conv_pw")
            bn(p + "expand_bn", t + "bn1")
            conv(p + "dwconv2", t + "conv_dw", depthwise=True)
            bn(p + "bn", t + "bn2")
            conv(p + "se_reduce", t + "se.conv_reduce")
            conv(p + "se_expand", t + "se.conv_expand")
            conv(p + "project_conv", t + "conv_pwl")
            bn(p + "project_bn", t + "bn3")
    conv("top_conv", "conv_head")
    bn("top_bn", "bn2")
    kernel, bias = layers["predictions"].get_weights()
    out["classifier.weight"], out["classifier.bias"] = kernel.T, bias
    return {k: np.ascontiguousarray(v.astype(np.int64 if v.dtype == np.int64 else np.float32)) for k, v in out.items()}


def download_failed(e):
    """Whether e (or what it was raised from) is a failed download: urllib's
    URLError (torchvision), a requests/huggingface_hub error (timm), both
    OSErrors, or Keras' "URL fetch failure" (its get_file)."""
    while e is not None:
        if isinstance(e, OSError) or "URL fetch failure" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def first_line(e):
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= 160 else text[:157] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, choices=("torchvision", "timm", "keras"))
    ap.add_argument("--model", required=True, choices=[f"effv2-{s}" for s in SIZES])
    ap.add_argument("--out", required=True)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--predict")
    ap.add_argument("--predictions")
    a = ap.parse_args()
    if bool(a.predict) != bool(a.predictions):
        sys.exit("--predict and --predictions go together")
    size = a.model[-1]
    source = {"torchvision": torchvision_weights, "timm": timm_weights, "keras": keras_weights}[a.source]
    images = read_batch(a.predict) if a.predict else noise_images(1)
    try:
        weights, padding, run, calibrate = source(size, a.random, a.classes, images)
    except Exception as e:  # noqa: BLE001 (only a failed download is answered here; anything else goes on up)
        if a.random or not download_failed(e):
            raise
        sys.exit(f"export_pretrained.py: cannot download {a.source}'s ImageNet weights for {a.model} ({first_line(e)}): "
                 f"this needs the internet or the framework's cache; for a trial without them, --random writes the same "
                 f"network with random weights")
    if calibrate:
        calibrate(images)
    tensors = weights()
    # "weights": segnet train says so when a run starts from random ones
    write_safetensors(a.out, tensors, {"format": "pt", "padding": padding, "source": a.source,
                                       "weights": "random" if a.random else "imagenet"})
    if a.predict:
        p = run(images)
        with open(a.predictions, "w") as f:
            for i, row in enumerate(p):
                f.write(f"{i}," + ",".join(f"{v:.9g}" for v in row) + "\n")
    print(f"wrote {a.out}: {len(tensors)} tensors from {a.source} {a.model} ({'random' if a.random else 'ImageNet'} weights, "
          f"padding {padding})")


if __name__ == "__main__":
    main()
