#!/usr/bin/env python3
"""The residual network of `mixtape-mnist --model resnet` in PyTorch, trained the same way.

The same architecture (a 3x3 conv stem of 16 channels; three residual blocks of 16, 32 and
64 channels, the last two with stride 2 and a strided 1x1 conv shortcut; BatchNormalization
after every conv, convs without bias; global average pooling; Dense 10), the same
initialisation (Glorot uniform kernels, zero biases, BatchNorm epsilon 1e-3 and Keras'
momentum 0.99), the same optimizer (Adam, learning rate 0.002 decayed by a cosine over all
steps, epsilon 1e-7) and batch size (128). One difference: a strided 'same' 3x3 conv pads
one pixel on both sides here and, as TensorFlow does, only after in mixtape (the output
sizes agree). The shuffling order differs (another generator).

Augmentation as `--augment` of the trainer (auto: shift on MNIST, flip on Fashion-MNIST):
shift moves each training image by a whole number of pixels drawn as
round(U(-0.075, 0.075) * 28) per axis (at most 2), the pixels moved in black; flip mirrors
it left-right with probability 1/2; the test images are used as they are.

  /usr/bin/python3 bench/reference_resnet.py --data ../shared/datasets/mnist \\
      --precision mixed_bfloat16 --epochs 5

Precisions: float32 | mixed_bfloat16 | mixed_float16 (torch.autocast; GradScaler for
float16 on a GPU). Prints one JSON line like shared/bench/reference_pytorch.py:
us_per_sample (median over the epochs after the first), per-epoch times, test accuracy.
"""
import argparse
import contextlib
import gzip
import json
import math
import os
import statistics
import struct
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        data = f.read()
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir):
    def one(stem):
        for name in (stem, stem + ".gz"):
            path = os.path.join(data_dir, name)
            if os.path.exists(path):
                return read_idx(path)
        raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")
    images = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)
    labels = lambda a: torch.from_numpy(a.astype(np.int64))
    return (images(one("train-images-idx3-ubyte")), labels(one("train-labels-idx1-ubyte")),
            images(one("t10k-images-idx3-ubyte")), labels(one("t10k-labels-idx1-ubyte")))


def augment(x, kind, gen):
    """RandomTranslation(0.075, 0.075, fill constant 0) and RandomFlip('horizontal')."""
    if kind == "none":
        return x
    n, _, h, w = x.shape
    dy = torch.zeros(n, dtype=torch.long)
    dx = torch.zeros(n, dtype=torch.long)
    if kind != "flip":
        dy = torch.round((torch.rand(n, generator=gen) * 0.15 - 0.075) * h).long()
        dx = torch.round((torch.rand(n, generator=gen) * 0.15 - 0.075) * w).long()
    rows = torch.arange(h).view(1, h, 1) - dy.view(n, 1, 1)  # output (i, j) reads (i-dy, j-dx)
    cols = torch.arange(w).view(1, 1, w) - dx.view(n, 1, 1)
    if kind != "shift":
        flip = torch.rand(n, generator=gen) < 0.5
        cols = torch.where(flip.view(n, 1, 1), (w - 1) - cols, cols)
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    src = torch.arange(n).view(n, 1, 1) * h * w + rows.clamp(0, h - 1) * w + cols.clamp(0, w - 1)
    out = x.reshape(n * h * w)[src.reshape(-1).to(x.device)].reshape(n, 1, h, w)
    return out * inside.view(n, 1, h, w).to(x.device, x.dtype)


def conv_bn(cin, cout, stride, kernel):
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01))  # Keras' momentum 0.99


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.first = conv_bn(cin, cout, stride, 3)
        self.second = conv_bn(cout, cout, 1, 3)
        self.shortcut = conv_bn(cin, cout, stride, 1) if stride != 1 or cin != cout else None

    def forward(self, x):
        h = self.second(F.relu(self.first(x)))
        return F.relu(h + (self.shortcut(x) if self.shortcut is not None else x))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(1, 16, 1, 3)
        self.blocks = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2))
        self.logits = nn.Linear(64, 10)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.blocks(F.relu(self.stem(x)))
        return self.logits(x.mean(dim=(2, 3)))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--precision", default="float32",
                    choices=["float32", "mixed_float16", "mixed_bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "fashion"],
                    help="names the data only to pick --augment auto's kind")
    ap.add_argument("--augment", default="auto",
                    choices=["auto", "none", "shift", "flip", "shift+flip"])
    ap.add_argument("--limit", type=int, default=0,
                    help="train on the first N training images only (as mixtape-mnist's)")
    a = ap.parse_args()
    kind = a.augment if a.augment != "auto" else ("flip" if a.dataset == "fashion" else "shift")
    gen = torch.Generator().manual_seed(a.seed + 1)

    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    xs, ys, xt, yt = (t.to(dev) for t in load(a.data))
    if a.limit > 0:
        xs, ys = xs[:a.limit], ys[:a.limit]
    net = ResNet().to(dev)
    n, bs = xs.shape[0], a.batch_size
    steps = math.ceil(n / bs) * a.epochs
    opt = torch.optim.Adam(net.parameters(), lr=2e-3, eps=1e-7)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps)))
    low = {"mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16}.get(a.precision)
    scaler = torch.cuda.amp.GradScaler(enabled=(low == torch.float16 and dev.type == "cuda"))
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    autocast = ((lambda: torch.autocast(device_type=dev.type, dtype=low)) if low is not None
                else contextlib.nullcontext)

    epoch_s = []
    for _ in range(a.epochs):
        net.train()
        perm = torch.randperm(n, device=dev)
        sync()
        t0 = time.perf_counter()
        for i in range(0, n, bs):
            idx = perm[i:i + bs]
            with autocast():
                logits = net(augment(xs[idx], kind, gen))
            loss = F.cross_entropy(logits.float(), ys[idx])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        sync()
        epoch_s.append(time.perf_counter() - t0)

    net.eval()
    correct = 0
    with torch.no_grad(), autocast():
        for i in range(0, xt.shape[0], 1000):
            correct += (net(xt[i:i + 1000]).argmax(1) == yt[i:i + 1000]).sum().item()
    steady = epoch_s[1:] or epoch_s
    print(json.dumps({
        "peer": "pytorch", "version": torch.__version__, "model": "resnet",
        "precision": a.precision, "device": a.device, "threads": torch.get_num_threads(),
        "batch_size": bs, "epochs": a.epochs, "epoch_s": [round(t, 4) for t in epoch_s],
        "us_per_sample": round(statistics.median(steady) / n * 1e6, 4),
        "test_accuracy": correct / xt.shape[0]}))


if __name__ == "__main__":
    main()
