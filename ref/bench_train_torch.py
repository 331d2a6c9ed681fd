#!/usr/bin/python3
"""The PyTorch side of the end-to-end row of `make bench`: a whole training
run done as a plain PyTorch loop, doing the work `segnet train` does with the
same options, on the same threads:

- a DataLoader over the same folders (DIR/images/*.png, DIR/masks/*.png of
  the same names), decoding every image each epoch, a random horizontal flip
  of image and mask together (--augment flip), images x/128 - 1 (segnet's
  rescale layer), shuffled batches;
- ref/parity_live.py's U-Net (--depth, --width), Adam (ε 1e-7, as Keras and
  segnet) with a cosine schedule over the run's steps;
- the loss Σ w[y]·nll / Σ w[y] over each batch (--class-weights);
- after each epoch the validation set in inference mode (its loss, and the
  mean IoU over the classes of weight > 0 from one confusion matrix), and a
  checkpoint (weights and Adam state) written to a temporary file, flushed to
  disk and renamed over OUT/last.pt, as segnet writes last.safetensors.

usage: ref/bench_train_torch.py --data TRAIN --val VAL --classes K
           [--class-weights W,...] [--model unet] [--depth D] [--width W]
           [--size HxW] [--batch B] [--epochs E] [--lr LR] [--schedule cosine]
           [--augment flip] [--threads T] [--workers N] --out DIR

Prints train_seconds (wall time from the start to the last checkpoint),
best_val_mIoU, and where the time went as segnet train's `seconds:` line
does (from the process's start, Python's own start-up and imports included:
start-up to the first batch asked for, steps, waiting for the DataLoader,
validation, checkpoints, the rest). Options segnet train has and this loop
does not use are refused.
"""
import argparse
import math
import os
import sys
import time

sys.dont_write_bytecode = True  # no ref/__pycache__ in the work tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision.io as tvio  # noqa: E402
from parity_live import UNet  # noqa: E402  (the reference U-Net, not a copy)


class SegFolder(torch.utils.data.Dataset):
    def __init__(self, root, flip, seed):
        self.images = os.path.join(root, "images")
        self.masks = os.path.join(root, "masks")
        self.names = sorted(n for n in os.listdir(self.images) if n.lower().endswith(".png"))
        if not self.names:
            raise SystemExit(f"bench_train_torch.py: {self.images}: no PNG images")
        self.flip = flip
        self.seed = seed

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        img = tvio.read_image(os.path.join(self.images, name), tvio.ImageReadMode.RGB).float() / 128.0 - 1.0
        mask = tvio.read_image(os.path.join(self.masks, name), tvio.ImageReadMode.GRAY)[0].long()
        if self.flip and torch.rand(()) < 0.5:
            img, mask = img.flip(-1), mask.flip(-1)
        return img, mask


def process_age_seconds():
    """Seconds since this process started (its start time in /proc/self/stat,
    field 22, in clock ticks since boot)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22; fields[0] is field 3
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start


def atomic_save(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    d = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    os.fsync(d)
    os.close(d)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--class-weights", default=None)
    p.add_argument("--model", default="unet")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--size", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", default="constant", choices=["constant", "cosine"])
    p.add_argument("--augment", default="none", choices=["none", "flip"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.model != "unet":
        raise SystemExit(f"bench_train_torch.py: --model {a.model!r}: only unet")
    t0 = time.perf_counter()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    K = a.classes
    w = [1.0] * K if a.class_weights is None else [float(v) for v in a.class_weights.split(",")]
    if len(w) != K:
        raise SystemExit(f"bench_train_torch.py: --class-weights has {len(w)} values for {K} classes")
    weights = torch.tensor(w)
    train = SegFolder(a.data, a.augment == "flip", a.seed)
    val = SegFolder(a.val, False, a.seed)
    if a.size:
        h, wd = (int(v) for v in a.size.split("x"))
        probe = train[0][0]
        if probe.shape[1:] != (h, wd):
            raise SystemExit(f"bench_train_torch.py: --size {a.size}: the images are {probe.shape[2]}x{probe.shape[1]} "
                             "(this loop does not resize)")
    loader = torch.utils.data.DataLoader(train, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                         persistent_workers=a.workers > 0)
    val_loader = torch.utils.data.DataLoader(val, batch_size=a.batch, shuffle=False, num_workers=a.workers,
                                             persistent_workers=a.workers > 0)
    model = UNet(K, depth=a.depth, width=a.width)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, eps=1e-7)
    total = a.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, (lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / total))) if a.schedule == "cosine" else (lambda s: 1.0))
    os.makedirs(a.out, exist_ok=True)
    best = -1.0
    startup = process_age_seconds()
    steps = loader_wait = validation = checkpoint = 0.0
    for epoch in range(a.epochs):
        model.train()
        batches = iter(loader)
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            loader_wait += time.perf_counter() - t
            if batch is None:
                break
            t = time.perf_counter()
            x, y = batch
            z = model(x)
            loss = F.cross_entropy(z, y, weight=weights, reduction="sum") / weights[y].sum().clamp_min(1e-12)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            steps += time.perf_counter() - t
        t = time.perf_counter()
        model.eval()
        cm = torch.zeros(K, K, dtype=torch.int64)
        nll, norm = 0.0, 0.0
        with torch.no_grad():
            for x, y in val_loader:
                z = model(x)
                nll += F.cross_entropy(z, y, weight=weights, reduction="sum").item()
                norm += weights[y].sum().item()
                cm += torch.bincount(y.flatten() * K + z.argmax(1).flatten(), minlength=K * K).view(K, K)
        ious = [cm[c, c].item() / max(1, (cm[c, :].sum() + cm[:, c].sum() - cm[c, c]).item())
                for c in range(K) if w[c] > 0]
        miou = sum(ious) / len(ious)
        best = max(best, miou)
        validation += time.perf_counter() - t
        t = time.perf_counter()
        atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1},
                    os.path.join(a.out, "last.pt"))
        checkpoint += time.perf_counter() - t
        print(f"epoch {epoch + 1}/{a.epochs}  val_loss {nll / max(norm, 1e-12):.4f}  val_mIoU {miou:.4f}", file=sys.stderr)
    print(f"train_seconds: {time.perf_counter() - t0:.3f}")
    print(f"best_val_mIoU: {best:.4f}")
    total = process_age_seconds()
    other = total - startup - steps - loader_wait - validation - checkpoint
    print(f"seconds: total {total:.3f} startup {startup:.3f} steps {steps:.3f} loader_wait {loader_wait:.3f} "
          f"validation {validation:.3f} checkpoint {checkpoint:.3f} other {other:.3f}")


if __name__ == "__main__":
    main()
