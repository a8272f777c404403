"""`paratrain ckpt info DIR`: what a checkpoint holds, read offline (no process group, no model
code): who wrote it, where the loop stood, and every tensor with its dtype, shape and bytes.
`paratrain ckpt export DIR OUT.safetensors [--dtype bf16]`: its model as one file, a tensor at a
time (checkpoint/export.py)."""

from __future__ import annotations

import argparse

import torch

from paratrain import checkpoint
from paratrain.checkpoint.export import DTYPE_NAMES, export_checkpoint


def add_ckpt_parser(commands) -> None:
    ckpt = commands.add_parser("ckpt", help="inspect a checkpoint offline",
                               description="Inspect a paratrain checkpoint without a process group or "
                               "the model's code.")
    actions = ckpt.add_subparsers(dest="action", required=True, metavar="{info,export}")
    info = actions.add_parser("info", help="who wrote it, the loop's position, every tensor",
                              description="Check the checkpoint's files against their checksums, then "
                              "print who wrote it, where the loop stood, and every tensor stored.")
    info.add_argument("path", metavar="DIR", help="a checkpoint directory (root/step-…)")
    export = actions.add_parser("export", help="the model as one .safetensors file",
                                description="Write the checkpoint's model as one .safetensors file with "
                                "the model's own state-dict keys, a tensor at a time (memory peaks at about "
                                "the largest tensor). Checks the checksums first.")
    export.add_argument("path", metavar="DIR", help="a checkpoint directory (root/step-…)")
    export.add_argument("out", metavar="OUT.safetensors")
    export.add_argument("--dtype", choices=sorted(DTYPE_NAMES),
                        help="cast floating-point tensors (default: as stored)")


def ckpt(args: argparse.Namespace) -> None:
    if args.action == "export":
        done = export_checkpoint(args.path, args.out, DTYPE_NAMES.get(args.dtype))
        print(f"wrote {args.out}: {done['tensors']} tensors, {done['bytes']:,} bytes "
              f"(largest tensor read: {done['largest']:,} bytes)")
        return
    meta, tensors = checkpoint.describe(args.path)
    state = meta.get("state", {})
    print(f"checkpoint {args.path}")
    print(f"  written by {meta['world_size']} process(es), strategy {state.get('strategy', '?')}, "
          f"optimizer {state.get('optimizer') or 'none'}")
    micro, accumulate = state.get("micro_step", 0), state.get("accumulate")
    steps = f", optimizer steps {micro // accumulate} (accumulate {accumulate})" if accumulate else ""
    print(f"  epoch {state.get('epoch', 0)}, micro-batches trained {micro}{steps}")
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in tensors]
    groups: dict[str, list[int]] = {}
    for (key, _, _), size in zip(tensors, sizes):
        totals = groups.setdefault(key.split("/")[0], [0, 0])
        totals[0], totals[1] = totals[0] + 1, totals[1] + size
    print("  " + "; ".join(f"{kind}: {n} tensors, {size:,} bytes" for kind, (n, size) in groups.items()))
    for (key, dtype, shape), size in zip(tensors, sizes):
        print(f"    {key:<48} {str(dtype).removeprefix('torch.'):<9} {list(shape)!s:<16} {size:,} bytes")
