#!/usr/bin/env python3
"""The character-level GPT of `mixtape-charlm` in PyTorch, trained the same way.

The same corpus and split (the bytes of --text, or of Debian's fortunes files in name
order; vocabulary: the distinct bytes, sorted; the first 90% of --text trains, the rest
validates; each fortunes file is split so, at a fortune's start),
the same model (token embedding + learned position embedding, pre-LayerNorm blocks of
causal multi-head self-attention and a 4x GELU MLP (exact GELU) with residual adds, a
final LayerNorm, logits over the vocabulary; LayerNorm epsilon 1e-5; weights drawn from
N(0, 0.02), biases 0), the same optimizer (AdamW, betas 0.9 / --beta2, epsilon 1e-8,
decoupled weight decay on every parameter, the gradients clipped to a global norm), the
same schedule (linear warm-up to --lr, then a cosine to --lr * --min-lr-ratio), and the
same data order: window offsets drawn by SplitMix64 seeded with --seed, offset =
next() % (training bytes - context), batch by batch. The initial weights differ (another
generator). Adam's epsilon enters as PyTorch has it (added to sqrt(v_hat)); mixtape adds it
as Keras does (to sqrt(v)); with 1e-8 the difference is below anything measured here.

  /usr/bin/python3 bench/charlm_reference.py --precision mixed_bfloat16
  python3 bench/charlm_reference.py --device cuda --preset gpt2-small --batch 8 \
      --precision mixed_bfloat16 --text corpus.txt --steps 60 [--compile]

Precisions: float32 | mixed_bfloat16 (torch.autocast, bfloat16) | mixed_float16 (CUDA only:
torch.autocast float16 with a GradScaler). On CUDA the model is written as a PyTorch user
writes it today: F.scaled_dot_product_attention(is_causal=True) (--attention sdpa, the
default there; the composed form, float32 logits as mixtape's MultiHeadAttention, is the
CPU's default), the fused AdamW, optionally torch.compile. The loss is read back only at
progress lines. Prints progress lines and, last, one JSON line: validation bits per
character over every non-overlapping window of the validation text, training tokens per
second (the steps after the first, timed from the end of the first to the end of the last,
the device synchronized at both), steps, and on CUDA the card and the peak memory PyTorch
allocated.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

FORTUNES = "/usr/share/games/fortunes"
MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def read_corpus(path):
    """The texts of the corpus as (bytes, split) pairs: the first `split` bytes train.

    --text: one file, split at 90%. The fortunes: each file split in itself, at the first
    fortune (after a line holding '%') that starts in its last tenth.
    """
    if path:
        with open(path, "rb") as f:
            data = f.read()
        return [(data, len(data) * 9 // 10)]
    names = sorted(
        n for n in os.listdir(FORTUNES)
        if "." not in n and os.path.isfile(os.path.join(FORTUNES, n))
        and not os.path.islink(os.path.join(FORTUNES, n)))
    sources = []
    for n in names:
        with open(os.path.join(FORTUNES, n), "rb") as f:
            data = f.read()
        tenth = len(data) * 9 // 10
        sep = data.find(b"\n%\n", tenth - 1) if tenth > 0 else -1
        sources.append((data, len(data) if sep < 0 else sep + 3))
    return sources


class Block(nn.Module):
    def __init__(self, width, heads, sdpa):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # The logits and softmax in float32, as mixtape's MultiHeadAttention does.
            logits = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d // self.heads)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            weights = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            a = weights.to(v.dtype) @ v
        a = a.transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, vocab, width, heads, layers, context, sdpa):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads, sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(width, eps=1e-5)
        self.logits = nn.Linear(width, vocab)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 0.02)
        nn.init.normal_(self.pos, 0.0, 0.02)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.logits(self.ln(x)).float()


def windows(data, offsets, context):
    idx = (torch.tensor(offsets, device=data.device).unsqueeze(1)
           + torch.arange(context + 1, device=data.device).unsqueeze(0))
    w = data[idx]
    return w[:, :-1], w[:, 1:]


def bits_per_char(model, data, context, batch, autocast):
    offsets = list(range(0, len(data) - context, context))
    total = 0.0
    model.eval()
    with torch.no_grad(), autocast():
        for i in range(0, len(offsets), batch):
            x, y = windows(data, offsets[i:i + batch], context)
            logits = model(x)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                     reduction="sum").item()
    model.train()
    return total / (len(offsets) * context) / math.log(2.0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default="")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=7000)
    p.add_argument("--precision", default="float32",
                   choices=["float32", "mixed_bfloat16", "mixed_float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default="", choices=["", "gpt2-small"],
                   help="gpt2-small: 12 layers, width 768, 12 heads, context 1024")
    p.add_argument("--attention", default="", choices=["", "composed", "sdpa"],
                   help="default: sdpa on CUDA, composed on the CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-every", type=int, default=250)
    p.add_argument("--profile-step", type=int, default=0,
                   help="mark this step (1-based) for a profiler told to record only such "
                        "ranges (cudaProfilerStart/Stop, as mixtape-charlm --kernel-census "
                        "marks its second step); 0: none")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="intra-op threads (mixtape uses every core, as OpenMP does)")
    a = p.parse_args()
    if a.preset == "gpt2-small":
        a.layers, a.width, a.heads, a.context = 12, 768, 12, 1024
    if a.precision == "mixed_float16" and a.device != "cuda":
        p.error("--precision mixed_float16 needs --device cuda")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: PyTorch sees no GPU")
    sdpa = (a.attention or ("sdpa" if a.device == "cuda" else "composed")) == "sdpa"
    if sdpa and not hasattr(F, "scaled_dot_product_attention"):
        p.error(f"--attention sdpa needs PyTorch 2.0 or later (this is {torch.__version__})")
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    sources = read_corpus(a.text)
    vocab = sorted(set(b"".join(data for data, _ in sources)))
    table = torch.full((256,), -1, dtype=torch.long)
    for i, b in enumerate(vocab):
        table[b] = i
    def ids(data):
        return table[torch.tensor(list(data), dtype=torch.long)]
    train = ids(b"".join(data[:split] for data, split in sources)).to(device)
    val = ids(b"".join(data[split:] for data, split in sources)).to(device)

    torch.manual_seed(a.seed)
    model = CharLM(len(vocab), a.width, a.heads, a.layers, a.context, sdpa).to(device)
    fused = {"fused": True} if a.device == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, a.beta2), eps=1e-8,
                            weight_decay=a.weight_decay, **fused)
    step_model = torch.compile(model) if a.compile else model
    scaler = torch.cuda.amp.GradScaler(enabled=a.precision == "mixed_float16")
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    floor = a.lr * a.min_lr_ratio

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = min(1.0, (step - a.warmup) / max(a.steps - a.warmup, 1))
        return floor + (a.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    def autocast():
        dtype = torch.float16 if a.precision == "mixed_float16" else torch.bfloat16
        return torch.autocast(a.device, dtype=dtype, enabled=a.precision != "float32")

    rng = SplitMix64(a.seed)
    span = len(train) - a.context
    first_done, window = None, []
    profiling = a.profile_step > 0 and a.device == "cuda"
    for step in range(a.steps):
        if profiling and step + 1 == a.profile_step:
            torch.cuda.profiler.start()
        offsets = [rng.next() % span for _ in range(a.batch)]
        x, y = windows(train, offsets, a.context)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast():
            logits = step_model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if a.clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        scaler.step(opt)
        scaler.update()
        window.append(loss.detach())
        if profiling and step + 1 == a.profile_step:
            torch.cuda.profiler.stop()
        if step == 0:  # the first step (and a compilation) is not timed
            sync()
            first_done = time.perf_counter()
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            mean = torch.stack(window).float().mean().item()  # synchronizes
            seconds = time.perf_counter() - first_done
            print(f"step {step + 1:>6}  loss {mean / math.log(2):.4f} bits/char  "
                  f"lr {lr_at(step):.3g}  {step * a.batch * a.context / max(seconds, 1e-9):.0f} "
                  "tokens/s", flush=True)
            window = []
    sync()
    seconds = time.perf_counter() - first_done
    tokens = (a.steps - 1) * a.batch * a.context
    val_bpc = bits_per_char(model, val, a.context, a.batch, autocast)
    result = {"framework": "pytorch", "torch": torch.__version__, "device": a.device,
              "precision": a.precision, "attention": "sdpa" if sdpa else "composed",
              "compile": a.compile, "layers": a.layers, "width": a.width, "heads": a.heads,
              "context": a.context, "batch": a.batch, "steps": a.steps,
              "val_bits_per_char": val_bpc, "tokens_per_s": tokens / max(seconds, 1e-9),
              "threads": torch.get_num_threads()}
    if a.device == "cuda":
        result["card"] = torch.cuda.get_device_name()
        result["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    print(json.dumps(result))


if __name__ == "__main__":
    main()
