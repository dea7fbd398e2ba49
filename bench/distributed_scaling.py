#!/usr/bin/env python3
"""Data-parallel throughput on one machine: 2 ranks x 1 thread against 1 rank x 1 thread.

Runs the MNIST trainer (and the character-level GPT) under `mpirun -np 1` and `-np 2`, the
two alternated for several rounds, and prints the median time per sample (per token for
the charlm) of each and their ratio: the table of docs/distributed.md. Each rank runs one
OpenMP thread (mpirun binds a rank to a core; OMP_NUM_THREADS=1 is set for both runs so
that the single process does not use the second core).

    python3 bench/distributed_scaling.py --build build --data-dir ../shared/datasets/mnist
"""
import argparse
import os
import re
import statistics
import subprocess
import sys


def run(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    return out.stdout.replace("\r", "\n")


def mnist_us_per_sample(text):
    # The epoch lines: "469/469 - 2.4s - 40us/sample - loss: ..."; the last epoch's.
    values = re.findall(r"- (\d+)us/sample", text)
    if not values:
        sys.exit("no us/sample in the trainer's output:\n" + text)
    return float(values[-1])


def charlm_tokens_per_s(text):
    m = re.search(r"training throughput (\d+) tokens/s", text)
    if not m:
        sys.exit("no throughput in the charlm's output:\n" + text)
    return float(m.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default="build")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mpirun", default="mpirun")
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mnist = os.path.join(args.build, "apps/mnist/mixtape-mnist")
    charlm = os.path.join(args.build, "apps/charlm/mixtape-charlm")
    workloads = [
        ("mlp, batch 128, 2 epochs", [mnist, "--data-dir", args.data_dir, "--model", "mlp",
                                      "--epochs", "2", "--verbose", "2"], mnist_us_per_sample),
        ("mlp, batch 256, 2 epochs", [mnist, "--data-dir", args.data_dir, "--model", "mlp",
                                      "--epochs", "2", "--batch-size", "256", "--verbose", "2"],
         mnist_us_per_sample),
        ("cnn, batch 128, 1 epoch", [mnist, "--data-dir", args.data_dir, "--model", "cnn",
                                     "--epochs", "1", "--verbose", "2"], mnist_us_per_sample),
    ]
    if os.path.exists("/usr/share/games/fortunes"):
        workloads.append(("charlm defaults, 200 steps (tokens/s)",
                          [charlm, "--steps", "200", "--log-every", "200", "--sample", "0"],
                          charlm_tokens_per_s))
    print("| workload | 1 rank x 1 thread | 2 ranks x 1 thread | speed-up |")
    print("|---|---|---|---|")
    for name, cmd, parse in workloads:
        one, two = [], []
        for _ in range(args.rounds):
            one.append(parse(run([args.mpirun, "-np", "1"] + cmd, env)))
            two.append(parse(run([args.mpirun, "-np", "2"] + cmd, env)))
        m1, m2 = statistics.median(one), statistics.median(two)
        tokens = "tokens/s" in name
        speedup = m2 / m1 if tokens else m1 / m2
        unit = "" if tokens else " us/sample"
        print(f"| {name} | {m1:.0f}{unit} ({', '.join(f'{v:.0f}' for v in one)}) | "
              f"{m2:.0f}{unit} ({', '.join(f'{v:.0f}' for v in two)}) | {speedup:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
