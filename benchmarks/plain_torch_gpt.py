"""A plain PyTorch training script of the kind users copy: nanoGPT's CPU "baby GPT" on a character text.

One file, eager PyTorch, no jaxloop or torch_ref import: the PyTorch side of the benchmark row
e2e.script64, which races it against `python -m jaxloop.train --preset shakespeare --model.context 64
--batch_size 12 --steps 2000` on the same text. nanoGPT's shakespeare_char settings for a CPU: 4 layers,
4 heads, width 128, context 64, batch 12, 2000 iterations, AdamW (betas 0.9/0.99, weight decay 0.1 on
matrices and embeddings, gradient clipping at 1.0), lr 1e-3 -> 1e-4 cosine after 100 warmup
iterations, no dropout, no torch.compile, an estimate of the validation loss from 20 random batches
every 250 iterations.

So that the two final validation losses compare, the data and the model are jaxloop's (where nanoGPT's
differ): the first 90% of the characters train and the last 10% validate, the vocabulary is the sorted
set of training characters (plus "<unk>" for validation characters outside it); training batches are
windows of context + 1 characters at random offsets of the training split; the GPT is jaxloop's
(pre-LayerNorm blocks, LayerNorm eps 1e-5, one qkv projection, GELU with the tanh approximation, biases,
a head tied to the token embedding, normal(0.02) initialisation, zero biases); the learning rate of
iteration u is jaxloop's warmup-cosine (0 at u = 0, linear to the peak at u = 100, cosine to 1e-4 at
u = 2000). At the end, as jaxloop does, the loss over the WHOLE validation split (non-overlapping
windows, stride context) is evaluated and printed.

    python benchmarks/plain_torch_gpt.py --data.path ../shared/data/tinyshakespeare.txt

The last stdout line is one JSON object: the final val_loss, the script's wall time (from its first line,
torch's import included; the benchmark row times the whole process from outside), the iterations' time
per iteration with and without the periodic estimates, and the parts.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the script's own wall time starts before torch's import

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (a.view(b, t, self.heads, c // self.heads).transpose(1, 2) for a in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LayerNorm, head tied to the token embedding."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(u: int, a: argparse.Namespace) -> float:
    """Linear warmup from 0 to the peak over `warmup` iterations, then cosine down to min_lr at `iters`."""
    if u < a.warmup:
        return a.lr * u / a.warmup
    progress = min((u - a.warmup) / max(a.iters - a.warmup, 1), 1.0)
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data.path", dest="path", required=True, help="a UTF-8 text file")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min_lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval_interval", type=int, default=250)
    p.add_argument("--eval_iters", type=int, default=20)
    p.add_argument("--eval_batch_size", type=int, default=32, help="batch of the final whole-split evaluation")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t_setup = time.perf_counter()
    torch.manual_seed(a.seed)

    # data: first 90% train, last 10% validate; the vocabulary from the training characters
    with open(a.path, encoding="utf-8") as f:
        text = f.read()
    n_train = int(math.floor(len(text) * 0.9))
    chars = sorted(set(text[:n_train]))
    stoi = {c: i for i, c in enumerate(chars)}
    unk = len(chars)  # validation characters outside the training vocabulary
    vocab = len(chars) + (1 if set(text[n_train:]) - set(chars) else 0)
    train = torch.tensor([stoi[c] for c in text[:n_train]], dtype=torch.long)
    val = torch.tensor([stoi.get(c, unk) for c in text[n_train:]], dtype=torch.long)

    def batch(data: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - a.context, (size,))
        x = torch.stack([data[i : i + a.context] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + a.context] for i in ix])
        return x, y

    model = GPT(vocab, a.context, a.n_embd, a.n_layer, a.n_head)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.99),
        eps=1e-8,
    )

    @torch.no_grad()
    def estimate_val_loss() -> float:
        model.eval()
        losses = [model(*batch(val, a.batch_size)).item() for _ in range(a.eval_iters)]
        model.train()
        return sum(losses) / len(losses)

    @torch.no_grad()
    def whole_val_loss() -> float:
        """Mean loss over every non-overlapping validation window (stride context), as jaxloop evaluates."""
        model.eval()
        starts = list(range(0, len(val) - a.context, a.context))
        total = 0.0
        for i in range(0, len(starts), a.eval_batch_size):
            s = starts[i : i + a.eval_batch_size]
            x = torch.stack([val[j : j + a.context] for j in s])
            y = torch.stack([val[j + 1 : j + 1 + a.context] for j in s])
            total += model(x, y).item() * len(s)
        model.train()
        return total / len(starts)

    setup_s = time.perf_counter() - t_setup
    t_loop = time.perf_counter()
    estimate_s, estimates = 0.0, 0
    for it in range(a.iters):
        if it % a.eval_interval == 0:
            estimates += 1
            t = time.perf_counter()
            print(f"step {it}: val loss {estimate_val_loss():.4f}", flush=True)
            estimate_s += time.perf_counter() - t
        for group in opt.param_groups:
            group["lr"] = lr_at(it, a)
        loss = model(*batch(train, a.batch_size))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if it % 100 == 0:
            print(f"iter {it}: loss {loss.item():.4f}", flush=True)
    loop_s = time.perf_counter() - t_loop
    t = time.perf_counter()
    val_loss = whole_val_loss()
    final_eval_s = time.perf_counter() - t
    print(f"step {a.iters}: val loss {val_loss:.4f} (whole validation split)", flush=True)
    print(
        json.dumps(
            {
                "val_loss": val_loss,
                "iters": a.iters,
                "threads": torch.get_num_threads(),
                "wall_s": time.perf_counter() - T_START,
                "iter_ms": 1e3 * loop_s / a.iters,  # the loop's time per iteration, its periodic estimates included
                "update_ms": 1e3 * (loop_s - estimate_s) / a.iters,  # per iteration, the estimates left out
                "setup_s": setup_s,
                "loop_s": loop_s,
                "estimate_s": estimate_s,
                "estimates": estimates,
                "final_eval_s": final_eval_s,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
