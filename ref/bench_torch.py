#!/usr/bin/python3
"""The PyTorch side of `segnet bench`: the same model, input size, batch,
thread count and number of steps, full training steps (forward, cross
entropy, backward, Adam) on synthetic data, on the CPU or a GPU.

usage: ref/bench_torch.py --model NAME [--size HxW] [--batch B] [--steps S]
                          [--warmup W] [--threads T] [--classes K]
                          [--padding same|symmetric] [--depth D] [--width W]
                          [--device cpu|cuda] [--precision fp32|fp16|bf16]

NAME: effv2-s|m|l (torchvision's EfficientNetV2, its default dropout and
stochastic depth, as segnet's), unet (ref/parity_live.py's U-Net, imported),
unet-effv2-s|m|l (ref/parity_live.py's U-Net on torchvision's encoder).
On cuda the model is channels_last (NHWC, segnet's layout, cuDNN's fastest),
fp16/bf16 run under autocast (fp16 with a GradScaler), as a PyTorch user
would train. Prints, as segnet bench does:
  train_step_ms: X      median over the S timed steps
  images_per_s: Y
  peak_rss_bytes: Z     ru_maxrss of this process
  peak_device_bytes: D  on cuda: torch.cuda.max_memory_allocated()
"""
import argparse
import os
import resource
import sys
import time

sys.dont_write_bytecode = True  # no ref/__pycache__ in the work tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from parity_live import EFF, UNet, UNetEff  # noqa: E402  (the reference U-Nets, not copies)
from parity_effv2 import to_same  # noqa: E402


def build(args):
    if args.model.startswith("effv2-") and args.model[6:] in EFF:
        model = EFF[args.model[6:]](num_classes=args.classes)
        seg = False
    elif args.model == "unet":
        model, seg = UNet(args.classes, depth=args.depth, width=args.width), True
    elif args.model.startswith("unet-effv2-") and args.model[11:] in EFF:
        model, seg = UNetEff(args.model[11:], args.classes), True
    else:
        raise SystemExit(f"bench_torch.py: model {args.model!r}: want effv2-s|m|l, unet or unet-effv2-s|m|l")
    if args.padding == "same":
        to_same(model)
    return model, seg


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="unet")
    p.add_argument("--size", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--padding", default="same", choices=("same", "symmetric"))
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    args = p.parse_args()
    dev = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_torch.py: --device cuda: torch sees no GPU")
    amp = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.size is None:
        side = {"effv2-s": 384, "effv2-m": 480, "effv2-l": 480}.get(args.model, 256)
        h = w = side
    else:
        h, w = (int(v) for v in args.size.split("x"))
    torch.manual_seed(args.seed)
    model, seg = build(args)
    model.train()
    images = torch.randint(0, 256, (args.batch, 3, h, w)).float()  # NCHW, PyTorch's own layout
    labels = torch.randint(0, args.classes, (args.batch, h, w) if seg else (args.batch,))
    if args.device == "cuda":
        model = model.to(dev, memory_format=torch.channels_last)
        images = images.to(dev).contiguous(memory_format=torch.channels_last)
        labels = labels.to(dev)
        torch.backends.cudnn.benchmark = True
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    if hasattr(torch.amp, "GradScaler"):  # torch >= 2.3; older ones have it under torch.cuda.amp
        scaler = torch.amp.GradScaler("cuda", enabled=amp is torch.float16)
    else:
        scaler = torch.cuda.amp.GradScaler(enabled=amp is torch.float16)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        with torch.autocast(args.device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            logits = model(images / 128 - 1)  # segnet's Rescaling(1/128, -1) is in the model
            loss = F.cross_entropy(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    n = len(times)
    med = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    print(f"model: {args.model}  input ({args.batch},{h},{w},3)  classes {args.classes}  "
          f"parameters {sum(q.numel() for q in model.parameters())}  threads {torch.get_num_threads()}")
    print(f"train_step_ms: {1e3 * med:.2f}")
    print(f"images_per_s: {args.batch / med:.3f}")
    print(f"peak_rss_bytes: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")
    if args.device == "cuda":
        print(f"peak_device_bytes: {torch.cuda.max_memory_allocated()}")


if __name__ == "__main__":
    main()
