"""Train a transformers GPT-2 (built from a config: random weights, nothing downloaded) on the
docstrings of Python's standard library, with any strategy, then save it where
`GPT2LMHeadModel.from_pretrained` reads it.

    python examples/hf_causal_lm.py                                  # one process
    paratrain run -n 2 examples/hf_causal_lm.py --strategy zero3     # two, sharded
    paratrain run -n 2 examples/hf_causal_lm.py --strategy pipeline  # two stages (GPT-2's cut is built in)

The text and its characters are examples/gpt.py's (`stdlib_docstrings`, 96 characters, no
tokenizer to download). Batches are what a tokenizer gives a transformers model — a dict of
input_ids and labels — and `session.train_step(batch)` is called without a loss function: the
model computes its own (`outputs.loss`, labels shifted inside), and `weight="tokens"` makes the
mean over every label token of the global batch exact whatever the ranks hold. Every
`--checkpoint-every` steps it checkpoints to `--out/checkpoints` and, started again, resumes
there. At the end `--out/model` holds `config.json` and `model.safetensors`:

    GPT2LMHeadModel.from_pretrained("runs/hf/model")
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt.py: the text
from gpt import ALPHABET, stdlib_docstrings  # noqa: E402

import paratrain as pt  # noqa: E402


class Windows(Dataset):
    """`block`-character windows of the text at random places, as a tokenizer's dict would give."""

    def __init__(self, tokens: torch.Tensor, block: int, count: int, seed: int):
        self.tokens, self.block = tokens, block
        self.starts = torch.randint(0, len(tokens) - block, (count,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[self.starts[i]:self.starts[i] + self.block]  # (block,)
        return {"input_ids": ids, "labels": ids.clone()}  # the model shifts the labels itself


def gpt2(args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(ALPHABET), n_positions=args.block_size, n_embd=args.width,
                        n_layer=args.layers, n_head=args.heads, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="single" if "WORLD_SIZE" not in os.environ else "ddp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch of windows")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--out", default="runs/hf")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    strategy = pt.Pipeline(stages=2, microbatches=2) if args.strategy == "pipeline" else args.strategy
    session = pt.Session(strategy, seed=args.seed, max_grad_norm=1.0)
    tokens = torch.tensor([ALPHABET.index(c) for c in stdlib_docstrings()], dtype=torch.long)
    data = Windows(tokens, args.block_size, args.steps * args.batch_size, args.seed)
    model = gpt2(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    checkpoints = os.path.join(args.out, "checkpoints")
    if session.resume(checkpoints):
        session.print(f"resumed at optimizer step {session.micro_step}")
    session.print(f"GPT-2 of {session.num_parameters():,} parameters, {len(ALPHABET)} characters "
                  f"(uniform guess: {math.log(len(ALPHABET)):.3f} nats), strategy {args.strategy}")
    first = last = None
    for batch in session.progress(loader):
        loss = session.train_step(batch, weight="tokens").item()  # the model's own loss
        first = loss if first is None else first
        last = loss
        if session.micro_step % args.checkpoint_every == 0:
            session.checkpoint(checkpoints, keep=2)
    if first is not None:
        session.print(f"loss: first {first:.4f} last {last:.4f}")
    save_pretrained(session, model, os.path.join(args.out, "model"))
    session.close()
    return last


def save_pretrained(session: pt.Session, model, directory: str) -> None:
    """config.json and model.safetensors, the layout from_pretrained reads (gathered from every
    rank: a collective)."""
    os.makedirs(directory, exist_ok=True)
    session.export(os.path.join(directory, "model.safetensors"))
    if session.is_main:
        config = session.unwrap(model).config
        config.save_pretrained(directory)
        print(f"wrote {directory}: GPT2LMHeadModel.from_pretrained({directory!r})")


if __name__ == "__main__":
    main()
