"""Train a tiny character-level GPT on the docstrings of Python's own standard library.

    paratrain run -n 2 examples/gpt.py --strategy zero3     # two processes, blocks sharded
    paratrain run -n 2 examples/gpt.py --strategy zero3 --activation-checkpointing   # blocks recomputed
    paratrain run -n 2 examples/gpt.py --strategy zero3 --meta-init   # each rank builds only its shards
    paratrain run -n 2 examples/gpt.py --strategy zero3 --meta-init --init-from gpt.safetensors  # an --export
    paratrain run -n 4 examples/gpt.py --strategy pipeline --stages 4 --layers 4   # a block per stage
    paratrain run -n 2 examples/gpt.py --tp 2              # each block's weights split over two ranks
    paratrain run -n 4 examples/gpt.py --tp 2 --strategy zero3   # tp 2 x zero3 over 2
    paratrain run -n 2 examples/gpt.py --tp 2 --sequence-parallel   # norms on half the sequence each
    paratrain run -n 2 examples/gpt.py --cp 2 --seq 4096 --batch-size 4   # each sequence cut over two ranks
    python examples/gpt.py --strategy single                # one process, the reference

The text is every docstring (module, class, function) of a fixed, sorted list of standard-library
modules (`MODULES`), read from their source files with `ast`, in source order, ASCII only: about
270 KB of English with some code (273,448 characters on Python 3.11), shipped with every Python,
nothing to download. Tokens are characters (96). The last 10 % is held out for validation;
training reads `--steps` × `--batch-size` windows at random places of the rest, once.

The model is nanoGPT's decoder (Radford et al. 2019, as in Karpathy's nanoGPT): token and
position embeddings, `--layers` pre-LayerNorm blocks of causal self-attention and MLP, a final
LayerNorm and a head whose weight is the token embedding's (tied weights: one parameter used in
two places, which every strategy must handle). Under `--strategy zero3` each `Block` is a unit of
its own: its parameters are gathered just before its forward and backward and freed after.
With `--tp N` each block's projections are cut over N ranks (`GPT.tp_plan`, Megatron's split) and
`--strategy` runs over the world / N ranks that hold the same slices; `--sequence-parallel` also
cuts the activations between them along the sequence (the LayerNorms, embeddings and head run on
each rank's part). With `--cp N` each training
sequence is cut over N ranks (context parallelism: `pt.Mesh(cp=N)`); attention, written with
`F.scaled_dot_product_attention`, goes by ring between them, and the position embedding's
`torch.arange` is given each rank's global positions, with no change to the model.

The loop is a single-device loop; `pt.Session` makes it distributed. At the end rank 0 prints
`validation loss: …`, the tokens per second and a sample from the model, and writes
`metrics.csv` and `loss.png` to `--out`. Evaluation and sampling run on every rank through the
wrapped model, because under zero3 the parameters exist whole only inside its forward.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import importlib.util
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import paratrain as pt

MODULES = ("argparse", "calendar", "collections", "dataclasses", "datetime", "difflib", "enum",
           "fractions", "functools", "heapq", "inspect", "json", "logging", "pathlib", "random",
           "shutil", "statistics", "subprocess", "tempfile", "textwrap", "threading", "typing",
           "zipfile")
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # the characters kept: 96


# -- the text ----------------------------------------------------------------------------------


def stdlib_docstrings(modules: tuple[str, ...] = MODULES) -> str:
    """The docstrings of `modules`, in source order, ASCII only, separated by blank lines."""
    docs = []
    for name in modules:
        with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        nodes = [tree] + sorted((n for n in ast.walk(tree) if isinstance(n, kinds)), key=lambda n: n.lineno)
        docs += [doc for doc in map(ast.get_docstring, nodes) if doc]
    return "".join(c for c in "\n\n".join(docs) if c in ALPHABET)


class Windows(Dataset):
    """Windows of `block + 1` tokens starting at `starts`: the input is the first `block`, the
    target the last `block` (each position predicts the next character)."""

    def __init__(self, tokens: torch.Tensor, block: int, starts: torch.Tensor):
        self.tokens, self.block, self.starts = tokens, block, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[self.starts[i]:self.starts[i] + self.block + 1]  # (block + 1,)
        return chunk[:-1], chunk[1:]


def datasets(text: str, block: int, samples: int, seed: int) -> tuple[Windows, Windows]:
    """`samples` training windows at random places of the first 90 % of `text`; validation
    windows side by side over the last 10 %."""
    tokens = torch.tensor([ALPHABET.index(c) for c in text], dtype=torch.long)  # (chars,)
    split = int(len(tokens) * 0.9)
    train, val = tokens[:split], tokens[split:]
    starts = torch.randint(0, len(train) - block, (samples,), generator=torch.Generator().manual_seed(seed))
    return Windows(train, block, starts), Windows(val, block, torch.arange(0, len(val) - block, block))


# -- the model -----------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Queries, keys and values by three projections; the number of heads is read from their
    width, so under tensor parallelism (`--tp`), where each rank's q, k and v are its own heads'
    columns only, the same code runs on the local heads."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        # no bias on the keys: it adds q·b to every score of a query alike, which softmax ignores,
        # so its gradient is rounding noise, and Adam would step on that noise
        self.k = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x):  # x: (B, T, C)
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (self.q(x), self.k(x), self.v(x)))  # each (B, H, T, C/H); H this rank's heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """x + attention(LN(x)), then x + MLP(LN(x)): the unit zero3 gathers and frees."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    # what `pt.Mesh(tp=...)` cuts (Megatron's split): each block's q, k, v and first MLP layer by
    # their output columns, the attention's and the MLP's output projections by their input rows;
    # the embeddings, LayerNorms and the tied head are held whole by every rank
    tp_plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
               "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def __init__(self, vocab: int, block: int, layers: int, width: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)    # (V, C)
        self.positions = nn.Embedding(block, width)  # (T, C)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied (Press & Wolf 2017), as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2L)
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def init_weights(self, module: nn.Module) -> None:
        """What __init__ does, one module at a time: the init_fn of a GPT built on the meta
        device (--meta-init), which paratrain calls for each module a rank materialises."""
        self._init(module)
        if any(module is b.attn.proj or module is b.mlp[2] for b in self.blocks):
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * len(self.blocks)))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # embed → blocks → head: the protocol a pipeline cuts at named blocks (paratrain's
    # parallel/pipeline/cut.py); the first stage runs pipeline_embed, the last pipeline_head
    def pipeline_embed(self, idx):  # idx: (B, T) token ids → (B, T, C)
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))

    def pipeline_head(self, x):  # x: (B, T, C) → logits (B, T, V)
        return self.head(self.ln(x))

    def forward(self, idx):  # idx: (B, T) token ids → logits (B, T, V)
        x = self.pipeline_embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.pipeline_head(x)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (nanoGPT): two param groups."""
    params = list(model.parameters())  # the tied weight once
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99))


# -- evaluation and sampling: every rank, through the wrapped model ----------------------------


@torch.no_grad()
def evaluate(model: nn.Module, data: Windows, session: pt.Session, batch: int = 64) -> float:
    """Mean validation loss. Each data-parallel replica takes every replicas-th window, the same
    number on every rank, so each calls forward as often (zero3 gathers parameters inside it);
    the stages of one pipeline take the same windows, as they do in training."""
    model.eval()
    replicas, index = model.replicas, model.replica_index
    mine = Subset(data, range(index, len(data) - len(data) % replicas, replicas))
    total = 0.0
    for x, y in DataLoader(mine, batch_size=batch):
        x, y = session.to_device((x, y))  # (b, T), (b, T)
        total += next_token_loss(model(x), y).item() * len(x)
    model.train()
    return pt.mean_metrics(total / len(mine))


@torch.no_grad()
def sample(model: nn.Module, prompt: str, length: int, block: int, session: pt.Session,
           temperature: float = 0.8, seed: int = 0) -> str:
    """`prompt` and `length` characters drawn one at a time. Every rank samples with the same
    seed, so every rank draws the same text (and calls forward the same number of times)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    idx = torch.tensor([[ALPHABET.index(c) for c in prompt]], device=session.device)  # (1, T)
    for _ in range(length):
        logits = model(idx[:, -block:])[:, -1].float().cpu()  # (1, V)
        nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator)  # (1, 1)
        idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
    model.train()
    return "".join(ALPHABET[i] for i in idx[0].tolist())


# -- output --------------------------------------------------------------------------------------


def save_results(out: str, rows: list[dict], losses: list[float]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label="training loss (rank 0)", alpha=0.6)
    ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)


def strategy_for(name: str, stages: int = 2, schedule: str = "1f1b", tp: int = 1, cp: int = 1,
                 sequence_parallel: bool = False) -> str | pt.Strategy:
    """zero3 with each transformer block a unit of its own; a pipeline cut between blocks (the
    token embedding on the first stage, tied to the head on the last); with `tp` > 1 the blocks
    cut over tp ranks (GPT.tp_plan), with `cp` > 1 each sequence cut over cp ranks, and `name` the
    data parallelism over the rest; any other name as it is."""
    if tp > 1 or cp > 1:
        return pt.Mesh(tp=tp, cp=cp, dp=strategy_for(name), sequence_parallel=sequence_parallel)
    if name == "zero3":
        return pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(Block,)))
    if name == "pipeline":
        return pt.Pipeline(stages=stages, schedule=schedule, layers="blocks")
    return name


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", help="single | ddp | zero1 | zero2 | zero3 | pipeline")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (--strategy pipeline)")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule: 1f1b | gpipe")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallel: cut each block over this many ranks; --strategy (ddp, zero1-3) "
                             "then runs over the rest")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: cut the activations outside the cut layers along the sequence too")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallel: cut each sequence over this many ranks (2 x cp must divide "
                             "--block-size); --strategy then runs over the rest")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch, over all ranks")
    parser.add_argument("--block-size", "--seq", type=int, default=64, help="context length in characters")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128, help="embedding width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--sample-chars", type=int, default=200)
    parser.add_argument("--prompt", default="Return the ")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meta-init", action="store_true",
                        help="build the model on the meta device: each rank materialises only what it holds")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward instead of keeping them")
    parser.add_argument("--init-from", metavar="FILE",
                        help="start from these weights (.safetensors or a torch state dict), e.g. an --export")
    parser.add_argument("--export", metavar="FILE", help="write the trained weights to FILE (.safetensors)")
    parser.add_argument("--out", default="runs/gpt")
    args = parser.parse_args(argv)

    strategy = strategy_for(args.strategy, args.stages, args.schedule, args.tp, args.cp, args.sequence_parallel)
    session = pt.Session(strategy=strategy, seed=args.seed,
                         max_grad_norm=args.max_grad_norm,
                         activation_checkpointing="auto" if args.activation_checkpointing else None)
    train, val = datasets(stdlib_docstrings(), args.block_size, args.steps * args.batch_size, args.seed)
    with torch.device("meta") if args.meta_init else contextlib.nullcontext():
        model = GPT(len(ALPHABET), args.block_size, args.layers, args.width, args.heads)
    optimizer = adamw(model, args.lr)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)  # one epoch = --steps steps
    model, optimizer, loader = session.setup(model, optimizer, loader,
                                             init_fn=model.init_weights if args.meta_init else None)
    if args.init_from:
        pt.load_weights(model, args.init_from)  # each rank reads only what it holds
    # after setup: the scheduler must drive the optimizer setup() returned (zero3 rebuilds it)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps,
                                                   pct_start=0.1)

    session.print(f"{len(train.tokens) + len(val.tokens)} characters of stdlib docstrings, "
                  f"vocabulary {len(ALPHABET)} (uniform guess: {math.log(len(ALPHABET)):.4f} nats)")
    rows, losses, train_time = [], [], 0.0
    for step, batch in enumerate(session.progress(loader, desc="train"), start=1):
        tick = time.perf_counter()
        losses.append(session.train_step(batch, next_token_loss).item())  # .item() waits for the step
        schedule.step()
        train_time += time.perf_counter() - tick
        if step % args.eval_every == 0 or step == args.steps:
            recent = pt.mean_metrics(sum(losses[-args.eval_every:]) / len(losses[-args.eval_every:]))
            val_loss = evaluate(model, val, session)  # every rank: zero3 gathers inside forward
            tokens_per_s = round(step * args.batch_size * args.block_size / train_time)
            rows.append(dict(step=step, train_loss=round(recent, 6), val_loss=round(val_loss, 6),
                             tokens_per_s=tokens_per_s))
            session.print(f"step {step}: train loss {recent:.4f}  validation loss {val_loss:.4f}  "
                          f"{tokens_per_s} tokens/s")

    text = sample(model, args.prompt, args.sample_chars, args.block_size, session, seed=args.seed)
    session.print(f"validation loss: {val_loss:.4f}")
    session.print(f"tokens per second: {tokens_per_s} ({session.world_size} process(es), "
                  f"strategy {args.strategy}{f', tp {args.tp}' if args.tp > 1 else ''}{f', cp {args.cp}' if args.cp > 1 else ''}, "
                  f"{train_time:.1f} s of training)")
    session.print(f"sample:\n{text}\n")
    if args.export:
        session.export(args.export)
    if session.is_main:
        save_results(args.out, rows, losses)
        print(f"wrote {args.out}/metrics.csv and {args.out}/loss.png")
    session.close()
    return val_loss


if __name__ == "__main__":
    main()
