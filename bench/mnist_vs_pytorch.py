#!/usr/bin/env python3
"""Times mixtape-mnist against the PyTorch reference on the same MNIST workloads.

For each workload (model x precision) it runs, alternating, mixtape-mnist and the
reference (shared/bench/reference_pytorch.py: the same models, optimizers and batch
sizes; bench/reference_resnet.py for the resnet), `--rounds` times each, in the same session, and prints the steady-state
us/sample of both (the median over rounds of each run's median over its epochs after
the first), their ratio, and the test accuracies. Nothing else should run meanwhile.

  bench/mnist_vs_pytorch.py --app build/apps/mnist/mixtape-mnist \\
      --reference ../shared/bench/reference_pytorch.py --data ../shared/datasets/mnist

The reference needs PyTorch: Debian's python3-torch on the CPU (run with /usr/bin/python3),
python3 with torch on a GPU machine. Output: a Markdown table on stdout (and the raw runs
as JSON lines with --raw FILE).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {
    "mlp": ["float32", "mixed_bfloat16", "mixed_float16"],
    "cnn": ["float32", "mixed_bfloat16"],
    "guide": ["float32", "mixed_float16"],
    "resnet": ["float32", "mixed_bfloat16"],
}


def run_app(app, data, dataset, model, precision, epochs, threads, device):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [app, "--model", model, "--policy", precision, "--epochs", str(epochs),
               "--data-dir", data, "--dataset", dataset, "--metrics-out", metrics,
               "--verbose", "0", "--device", device]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows = [json.loads(line) for line in open(metrics)]
    steady = [r["us_per_sample"] for r in rows[1:]] or [rows[0]["us_per_sample"]]
    accuracy = None
    for line in out.splitlines():
        if line.startswith("Test accuracy:"):
            accuracy = float(line.split(":")[1])
    return {"peer": "mixtape", "model": model, "precision": precision,
            "us_per_sample": statistics.median(steady), "test_accuracy": accuracy,
            "epochs_us": [r["us_per_sample"] for r in rows]}


def run_reference(python, reference, data, dataset, model, precision, epochs, threads, device):
    cmd = [python, reference, "--data", data, "--precision", precision,
           "--device", device, "--epochs", str(epochs), "--threads", str(threads)]
    if model != "resnet":
        cmd += ["--model", model]
    else:
        cmd += ["--dataset", dataset]  # the same augmentation as the app's --augment auto
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # e.g. PyTorch 1.13 has no float16 autocast on the CPU
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"# the reference failed for {model} {precision} ({last}): no PyTorch time",
              file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default="build/apps/mnist/mixtape-mnist")
    ap.add_argument("--reference", default="../shared/bench/reference_pytorch.py")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the interpreter that has torch (Debian's python3-torch)")
    ap.add_argument("--resnet-reference", default="bench/reference_resnet.py")
    ap.add_argument("--data", default="../shared/datasets/mnist")
    ap.add_argument("--dataset", default="mnist", help="mnist or fashion (the files in --data)")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--precisions", default="",
                    help="comma-separated; default: per model, see WORKLOADS")
    ap.add_argument("--epochs", type=int, default=2, help="per run; the first is warm-up")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peers", default="mixtape,pytorch",
                    help="which to run (mixtape alone measures its own precision ratios)")
    ap.add_argument("--raw", default="")
    a = ap.parse_args()

    raw = open(a.raw, "w") if a.raw else None
    results = []
    started = time.time()
    for model in a.models.split(","):
        precisions = a.precisions.split(",") if a.precisions else WORKLOADS[model]
        for precision in precisions:
            ours, theirs = [], []
            for r in range(a.rounds):
                for peer in a.peers.split(","):
                    if peer == "mixtape":
                        res = run_app(a.app, a.data, a.dataset, model, precision, a.epochs,
                                      a.threads, a.device)
                        ours.append(res)
                    else:
                        reference = a.resnet_reference if model == "resnet" else a.reference
                        res = run_reference(a.python, reference, a.data, a.dataset, model, precision,
                                            a.epochs, a.threads, a.device)
                        if res is None:
                            continue
                        theirs.append(res)
                    res["round"] = r
                    if raw:
                        raw.write(json.dumps(res) + "\n")
                        raw.flush()
                    print(f"# {model} {precision} round {r} {peer}: "
                          f"{res['us_per_sample']:.1f} us/sample, "
                          f"test accuracy {res['test_accuracy']}", file=sys.stderr)
            m = statistics.median(x["us_per_sample"] for x in ours)
            p = statistics.median(x["us_per_sample"] for x in theirs) if theirs else float("nan")
            results.append((model, precision, m, p, ours[-1]["test_accuracy"],
                            theirs[-1]["test_accuracy"] if theirs else float("nan")))

    print(f"| workload | mixtape us/sample | PyTorch us/sample | PyTorch / mixtape | "
          f"mixtape test acc | PyTorch test acc |")
    print("|---|---|---|---|---|---|")
    for model, precision, m, p, am, ap_ in results:
        print(f"| {model} {precision} | {m:.1f} | {p:.1f} | {p / m:.2f}x | {am:.4f} | {ap_:.4f} |")
    own = {(mo, pr): m for mo, pr, m, _, _, _ in results}
    for (model, precision), m in sorted(own.items()):
        if precision != "float32" and (model, "float32") in own:
            print(f"\n{model} {precision} / {model} float32 (mixtape): "
                  f"{m / own[(model, 'float32')]:.2f}x", end="")
    print(f"\n\n{a.rounds} rounds, {a.epochs} epochs per run, {a.threads} threads, device "
          f"{a.device}, {time.time() - started:.0f} s in all")


if __name__ == "__main__":
    main()
