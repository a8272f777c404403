"""Benchmark: paratrain's tensor parallelism, pt.Mesh(tp=2), against torch's DTensor tensor parallelism.

    python bench/tensor_parallel.py [--rounds 5] [--steps 10] [--batch 512] [--out ...] [--quick]

World 2 on gloo, one thread per rank (2 ranks on 2 cores), ranks started by
`paratrain.testing.run_on_ranks`. The model: tests/support/llama.py's Llama-style decoder
(RMSNorm, SwiGLU, rotary positions, grouped-query attention), LAYERS blocks of width WIDTH,
fp32, trained with Adam. The same plan (q, k, v, gate, up "colwise"; o, down "rowwise"; the
embedding and LM head replicated) goes through pt.Mesh(tp=2)'s setup and through torch's
`parallelize_module` with ColwiseParallel / RowwiseParallel. `--batch` is tokens per step (both
tp ranks read the same batch), in sequences of 64.

Speed: each rank builds both from one seeded model and trains them on the same batches; after
warm-up steps, `--rounds` rounds in which each runs `--steps` timed steps, the order alternating
(bench/common.py, time_interleaved). A step (forward, loss, backward, Adam step, zero_grad) takes
as long as its slower rank; reported: the medians and ratio = ours / torch, and max_param_diff
between the two after the same steps.

Bytes: the collectives one step of ours issues, counted by wrapping torch.distributed's
functions (ours calls them), against the formula of Narayanan et al. (2021), §3.2: per block one
all-reduce of b·s·h elements after attention and one after the MLP in forward, one of each
half's input gradient in backward. torch's collectives (functional, under DTensor) are counted by
torch's CommDebugMode, as calls.

Memory: per rank, the distinct bytes of the parameters, their gradients and Adam's two moments
after a step, against 16 bytes × (replicated parameters + cut parameters / tp).

`llama_sp`: the same with sequence parallelism, ours `pt.Mesh(tp=2, sequence_parallel=True)` and
torch's SequenceParallel / PrepareModuleInput plan as torchtitan writes it, the embedding and head
cut by the vocabulary in both. Its bytes formula (Korthikanti et al. 2022, §4.2.2): per block
half an all-gather to b·s·h elements and a reduce-scatter to b·s·h / tp, each way; the embedding's
reduce-scatter and the head's gather of its input, each way; the logits gathered, b·s·V / tp per
rank; and an all-reduce of each norm weight's gradient (h each).
"""

from __future__ import annotations

import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]  # common.py and tests.support, for the ranks too
from common import (  # noqa: E402
    SEQ,
    bench_parser,
    distinct_storage_bytes,
    load_at_start,
    parse_bench_args,
    print_table,
    summarize_times,
    time_interleaved,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402
from tests.support.collectives import counting_collectives  # noqa: E402
from tests.support.llama import PLAN, Llama, lm_loss  # noqa: E402

WORLD, TP, THREADS, LR, DATA_BATCHES = 2, 2, 1, 1e-4, 4
LAYERS, WIDTH, HEADS, KV_HEADS, HIDDEN, VOCAB = 4, 512, 8, 4, 1376, 8192


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(vocab=VOCAB, width=WIDTH, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, hidden=HIDDEN)


def _batches(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100)
    ids = torch.randint(0, VOCAB, (DATA_BATCHES, tokens // SEQ, SEQ + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


SP_PLAN = {**PLAN, "embed": "rowwise", "lm_head": "colwise_rep"}  # sequence parallelism: the vocabulary cut


def _ours(model, topo, sequence=False):
    strategy = pt.Mesh(tp=TP, sequence_parallel=True, tp_plan=SP_PLAN) if sequence else pt.Mesh(tp=TP)
    wrapped, opt = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=LR), strategy.grid(topo))
    return wrapped, opt


def _torch(model, topo, sequence=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in PLAN.items()}
    if sequence:  # torchtitan's Llama plan
        parts, whole = (Shard(1), None), (Replicate(), None)  # a block's (hidden states, positions)
        plan.update({"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                     "layers.*.attn_norm": SequenceParallel(), "layers.*.mlp_norm": SequenceParallel(),
                     "layers.*.attn": PrepareModuleInput(input_layouts=parts, desired_input_layouts=whole),
                     "layers.*.mlp": PrepareModuleInput(input_layouts=parts[:1], desired_input_layouts=whole[:1]),
                     "layers.*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                     "layers.*.mlp.down": RowwiseParallel(output_layouts=Shard(1)), "norm": SequenceParallel(),
                     "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    parallelize_module(model, init_device_mesh("cpu", (topo.world_size,)), plan)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def _step(model, opt, x, y) -> torch.Tensor:
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _our_collectives(model, opt, x, y) -> list[tuple[str, int]]:
    """(function, elements) of each collective one training step of ours issues."""
    with counting_collectives() as calls:
        _step(model, opt, x, y)
    return calls


def _torch_collectives(model, opt, x, y) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        _step(model, opt, x, y)
    return {str(op): n for op, n in mode.get_comm_counts().items()}


def _held_bytes(model, opt, x, y) -> int:
    """Distinct bytes of the parameters, their gradients (after a backward) and the optimizer's
    state tensors (after the steps before), then the step is finished."""
    lm_loss(model(x), y).backward()
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    held = distinct_storage_bytes(dict(held=[*params, *state, *(p.grad for p in params)]))["held"]
    opt.step()
    opt.zero_grad()
    return held


def run(topo, tokens: int, warmup: int, rounds: int, steps: int, sequence: bool) -> dict:
    topo = topo.init()
    base = _model()
    whole = {n: p.numel() for n, p in base.named_parameters()}
    models = {"ours": _ours(copy.deepcopy(base), topo, sequence), "torch": _torch(copy.deepcopy(base), topo, sequence)}
    batches = _batches(tokens)
    step_of = {impl: (lambda x, y, impl=impl: _step(*models[impl], x, y)) for impl in models}
    timed = time_interleaved(step_of, batches, warmup=warmup, rounds=rounds, steps=steps)
    ours_state = models["ours"][0].full_state_dict()
    torch_state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in models["torch"][0].state_dict().items()}
    x, y = batches[0]
    cut = sum(n for name, n in whole.items() if name in models["ours"][0].shard_dims)
    out = dict(**timed, diff=max_param_diff(ours_state, torch_state),
               ours_calls=_our_collectives(*models["ours"], x, y), torch_calls=_torch_collectives(*models["torch"], x, y),
               held=_held_bytes(*models["ours"], x, y), expected_held=16 * (sum(whole.values()) - cut + cut // TP))
    pt.destroy()
    return out


def _parse_args(argv=None):
    parser = bench_parser(__doc__, out_name="tensor_parallel.json", rounds=5, steps=10, warmup=3, batch=512)
    return parse_bench_args(parser, argv, quick=dict(rounds=1, steps=2, warmup=1, batch=128))


def formula(tokens: int, sequence: bool) -> list[tuple[str, int]]:
    """The collectives one step should issue, (function, elements) as counting_collectives
    records them (an all-gather's or reduce-scatter's output), sorted (module docstring)."""
    b_s_h = tokens * WIDTH
    if not sequence:
        return sorted([("all_reduce", b_s_h)] * (4 * LAYERS))
    gather = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") else "reduce_scatter_tensor"
    each_way = [(gather, b_s_h), (scatter, b_s_h // TP)] * (2 * LAYERS + 1)  # blocks; the embedding, head input
    logits = [("all_gather", tokens * VOCAB // TP)]
    norms = [("all_reduce", WIDTH)] * (2 * LAYERS + 1)
    return sorted(2 * each_way + logits + norms)


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    results = {}
    for name, sequence in (("llama", False), ("llama_sp", True)):
        per_rank = run_on_ranks(run, WORLD, args.batch, args.warmup, args.rounds, args.steps, sequence,
                                threads=THREADS, timeout=1800)
        times = summarize_times(per_rank, ["ours", "torch"], args.steps)
        calls = per_rank[0]["ours_calls"]
        expected = formula(args.batch, sequence)
        big = sorted(c for c in calls if sequence or c[1] > 1)  # the loss's and Adam's scalars: none expected
        results[name] = dict(
            **times, ratio=times["ours_ms"] / times["torch_ms"], max_param_diff=max(r["diff"] for r in per_rank),
            bytes_per_step=4 * sum(n for _, n in calls), formula_bytes_per_step=4 * sum(n for _, n in expected),
            collectives_match_formula=big == expected and len(big) == len(calls),
            torch_collective_calls=per_rank[0]["torch_calls"],
            held_bytes=max(r["held"] for r in per_rank), formula_held_bytes=per_rank[0]["expected_held"],
        )
        results[name]["held_over_formula"] = results[name]["held_bytes"] / results[name]["formula_held_bytes"]
    print_table([dict(model=name, **result) for name, result in results.items()], [
        ("model", "model", "s"), ("ours_ms", "ours ms", ".1f"), ("torch_ms", "DTensor ms", ".1f"),
        ("ratio", "ours/torch", ".3f"), ("bytes_per_step", "bytes/step", "d"),
        ("formula_bytes_per_step", "formula", "d"), ("held_over_formula", "held/formula", ".3f")])
    settings = dict(world=WORLD, tp=TP, threads=THREADS, layers=LAYERS, width=WIDTH, heads=HEADS, kv_heads=KV_HEADS,
                    hidden=HIDDEN, vocab=VOCAB, tokens_per_step=args.batch, rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup, optimizer=f"Adam(lr={LR})")
    write_results(args, settings, load_before, ranks=WORLD, **results)


if __name__ == "__main__":
    main()
