#!/usr/bin/env python3
"""Training time on a quiet machine and beside one busy process: MNIST (mixtape and
PyTorch) and the character-level GPT (mixtape).

People train on laptops and shared servers where something else always runs. For each
workload (model x precision) and peer, each round runs the training twice: alone, then
while a process spins on one CPU (the last one this script may run on; started half a
second before the run, killed after it). Every peer runs with its default thread settings:
OMP_NUM_THREADS, OMP_WAIT_POLICY and MIXTAPE_CPU_THREADS_ADAPT are removed from the
environment, except where a peer sets one (below). The table gives the medians over rounds
of each run's steady us/sample (the median over its epochs after the first) and the ratio
loaded / quiet.

Peers:
  mixtape        mixtape-mnist as a user runs it (thread count adapting to the load)
  mixtape-fixed  the same with MIXTAPE_CPU_THREADS_ADAPT=0 (always the OpenMP default)
  pytorch        the reference (shared/bench/reference_pytorch.py, Debian's python3-torch),
                 its default thread count (torch.get_num_threads(): one on the 2-core
                 machine of docs/benchmarks.md)
  pytorch:N      the same with N threads (torch.set_num_threads)

The runs train on the first --train images of MNIST and test on the first --test (written
to a temporary directory as IDX files), so that a loaded PyTorch run stays short.

The workloads charlm64 and charlm512 are mixtape-charlm (--charlm) at its defaults with
context 64 (batch 32) and context 512 (batch 4), --charlm-steps steps on this repository's
docs/*.md as the text; their time is us per token (the app's tokens/s of the steps after the
first) and their peers mixtape and mixtape-fixed alone.

  bench/under_load.py --app build/apps/mnist/mixtape-mnist \\
      --reference ../shared/bench/reference_pytorch.py --data ../shared/datasets/mnist
"""
import argparse
import gzip
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

WORKLOADS = {"mlp": ["float32", "mixed_bfloat16"], "cnn": ["float32", "mixed_bfloat16"],
             "resnet": ["float32", "mixed_bfloat16"], "charlm64": ["float32", "mixed_bfloat16"],
             "charlm512": ["float32", "mixed_bfloat16"]}
# The charlm workloads: (context, batch).
CHARLM = {"charlm64": (64, 32), "charlm512": (512, 4)}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                    "MIXTAPE_CPU_THREADS_ADAPT")


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return data[:4], dims, data[4 + 4 * ndim:]


def write_subset(src_dir, dst_dir, train, test):
    """The first `train` training and `test` test images and labels, as .gz IDX files."""
    for stem, count in (("train-images-idx3-ubyte", train), ("train-labels-idx1-ubyte", train),
                        ("t10k-images-idx3-ubyte", test), ("t10k-labels-idx1-ubyte", test)):
        magic, dims, body = read_idx(os.path.join(src_dir, stem + ".gz"))
        count = min(count, dims[0])
        item = len(body) // dims[0]
        with gzip.open(os.path.join(dst_dir, stem + ".gz"), "wb", compresslevel=1) as f:
            f.write(magic + struct.pack(">" + "I" * len(dims), count, *dims[1:]))
            f.write(body[:count * item])


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(extra or {})
    return env


class Spinner:
    """A process that keeps one CPU busy while alive."""

    def __init__(self, cpu):
        self.cpu = cpu

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(self.proc.pid, {self.cpu})
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def run_mixtape(a, data, model, precision, extra_env):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [a.app, "--model", model, "--policy", precision, "--epochs", str(a.epochs),
               "--data-dir", data, "--metrics-out", metrics, "--verbose", "0", "--device", "cpu"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env=clean_env(extra_env)).stdout
        rows = [json.loads(line) for line in open(metrics)]
    accuracy = None
    for line in out.splitlines():
        if line.startswith("Test accuracy:"):
            accuracy = float(line.split(":")[1])
    steady = [r["us_per_sample"] for r in rows[1:]] or [rows[0]["us_per_sample"]]
    return statistics.median(steady), accuracy


def run_charlm(a, text, model, precision, extra_env):
    context, batch = CHARLM[model]
    cmd = [a.charlm, "--text", text, "--context", str(context), "--batch", str(batch),
           "--steps", str(a.charlm_steps), "--log-every", str(a.charlm_steps), "--eval-every",
           "0", "--sample", "0", "--policy", precision, "--device", "cpu"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env=clean_env(extra_env)).stdout
    for line in out.splitlines():
        if line.startswith("training throughput"):
            return 1e6 / float(line.split()[2]), None
    sys.exit(f"under_load.py: no throughput line from {' '.join(cmd)}:\n{out}")


def run_pytorch(a, data, model, precision, threads):
    cmd = [a.python, a.reference, "--data", data, "--model", model, "--precision", precision,
           "--device", "cpu", "--epochs", str(a.epochs), "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=clean_env()).stdout
    res = json.loads(out.strip().splitlines()[-1])
    return res["us_per_sample"], res.get("test_accuracy")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default="build/apps/mnist/mixtape-mnist")
    ap.add_argument("--reference", default="../shared/bench/reference_pytorch.py")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the interpreter that has torch (Debian's python3-torch)")
    ap.add_argument("--data", default="../shared/datasets/mnist")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--precisions", default="", help="comma-separated; default: per model")
    ap.add_argument("--peers", default="mixtape,mixtape-fixed,pytorch,pytorch:2")
    ap.add_argument("--epochs", type=int, default=2, help="per run; the first is warm-up")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--train", type=int, default=10000, help="training images per epoch")
    ap.add_argument("--test", type=int, default=2000, help="test images")
    ap.add_argument("--raw", default="", help="also write every run as a JSON line here")
    ap.add_argument("--charlm", default="build/apps/charlm/mixtape-charlm")
    ap.add_argument("--charlm-steps", type=int, default=30, help="steps per charlm run")
    a = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("under_load.py: needs at least two CPUs (one is given to the busy process)")
    raw = open(a.raw, "w") if a.raw else None

    def peers_of(model):  # PyTorch has no charlm peer here
        peers = a.peers.split(",")
        return [p for p in peers if not p.startswith("pytorch")] if model in CHARLM else peers

    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as data:
        write_subset(a.data, data, a.train, a.test)
        # The charlm's text: this repository's docs, concatenated.
        text = os.path.join(data, "docs.txt")
        docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
        with open(text, "w") as out:
            for name in sorted(os.listdir(docs)):
                if name.endswith(".md"):
                    out.write(open(os.path.join(docs, name)).read())
        for model in a.models.split(","):
            precisions = a.precisions.split(",") if a.precisions else WORKLOADS[model]
            for precision in precisions:
                times = {}
                for r in range(a.rounds):
                    for peer in peers_of(model):
                        for load in ("quiet", "loaded"):
                            def once():
                                extra = {"MIXTAPE_CPU_THREADS_ADAPT": "0"} \
                                    if peer == "mixtape-fixed" else {}
                                if model in CHARLM:
                                    return run_charlm(a, text, model, precision, extra)
                                if peer.startswith("pytorch"):
                                    threads = int(peer.split(":")[1]) if ":" in peer else 0
                                    return run_pytorch(a, data, model, precision, threads)
                                return run_mixtape(a, data, model, precision, extra)
                            if load == "loaded":
                                with Spinner(cpus[-1]):
                                    us, acc = once()
                            else:
                                us, acc = once()
                            times.setdefault((peer, load), []).append(us)
                            line = {"model": model, "precision": precision, "peer": peer,
                                    "load": load, "round": r, "us_per_sample": us,
                                    "test_accuracy": acc}
                            print("# " + json.dumps(line), file=sys.stderr)
                            if raw:
                                raw.write(json.dumps(line) + "\n")
                                raw.flush()
                for peer in peers_of(model):
                    q = statistics.median(times[(peer, "quiet")])
                    l_ = statistics.median(times[(peer, "loaded")])
                    rows.append((f"{model} {precision}", peer, q, l_, times[(peer, "quiet")],
                                 times[(peer, "loaded")]))

    print("| workload | peer | quiet us/sample (charlm: us/token) | beside a busy process | "
          "loaded / quiet | "
          "single rounds (quiet; loaded) |")
    print("|---|---|---|---|---|---|")
    for workload, peer, q, l_, qs, ls in rows:
        singles = ", ".join(f"{x:.1f}" for x in qs) + "; " + ", ".join(f"{x:.1f}" for x in ls)
        print(f"| {workload} | {peer} | {q:.1f} | {l_:.1f} | {l_ / q:.2f}x | {singles} |")
    print(f"\n{a.rounds} rounds, {a.epochs} epochs of {a.train} images per run, {len(cpus)} "
          f"CPUs, the busy process on CPU {cpus[-1]}, {time.time() - started:.0f} s in all")


if __name__ == "__main__":
    main()
