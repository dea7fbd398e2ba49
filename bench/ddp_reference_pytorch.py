#!/usr/bin/env python3
"""PyTorch DistributedDataParallel on the CPU: the peer of bench/distributed_scaling.py.

Trains the MNIST mlp (784-512-512-10 ReLU, Adam lr 1e-3, global batch 128, float32) with
N processes x 1 thread (gloo, DistributedDataParallel; each process takes its share of
every global batch, the shuffle seeded alike on every rank) and prints the time per sample
of the last epoch, the figure mixtape-mnist prints. Run with --world 1 and --world 2,
alternated, to compare 2 ranks against 1 the way bench/distributed_scaling.py does for
mixtape (docs/distributed.md has the table).

    python3 bench/ddp_reference_pytorch.py --data ../shared/datasets/mnist --world 2
"""
import argparse
import gzip
import os
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    _, _, ndim = struct.unpack(">HBB", data[:4])
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(data_dir, stem):
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"{stem} not found in {data_dir}")


def worker(rank, args):
    # One core per rank, as mpirun binds mixtape's ranks.
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    if args.world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
    images = read_idx(find(args.data, "train-images-idx3-ubyte"))[: args.limit]
    labels = read_idx(find(args.data, "train-labels-idx1-ubyte"))[: args.limit]
    x_all = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    y_all = torch.from_numpy(labels.astype(np.int64))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    if args.world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    n = len(x_all)
    rng = np.random.default_rng(args.seed)  # the same order on every rank
    times = []
    for _ in range(args.epochs):
        order = torch.from_numpy(rng.permutation(n))
        start = time.perf_counter()
        for b in range(0, n, args.batch_size):
            idx = order[b:b + args.batch_size]
            share = idx[len(idx) * rank // args.world: len(idx) * (rank + 1) // args.world]
            x, y = x_all[share], y_all[share]
            opt.zero_grad(set_to_none=True)
            # The mean over the share; DDP averages the ranks' gradients (equal shares).
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if args.world > 1:
            dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"world {args.world}: epochs {['%.2f s' % t for t in times]}, last epoch "
              f"{times[-1] / n * 1e6:.1f} us/sample")
    if args.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--limit", type=int, default=60000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    if args.world == 1:
        worker(0, args)
    else:
        mp.spawn(worker, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
