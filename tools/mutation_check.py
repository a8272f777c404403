"""Mutation check: plausible one-line bugs put into a copy of the library, each against the tests
that should catch it.

    python tools/mutation_check.py              every mutant (about 5 minutes on 2 cores)
    python tools/mutation_check.py NAME ...     the ones named
    python tools/mutation_check.py --check      only check that every snippet is still there
    python tools/mutation_check.py --baseline   also run the tests once on the unmutated copy

Not part of the test suite (it runs test files once per mutant); run it before closing an issue
that touches the parallel code, and put its table in the note. For each mutant the repository is
copied to a temporary directory (without .git, .venv and caches), the mutant's snippets are
replaced there, each of which must occur exactly once in the whole of paratrain/, wherever it sits
(`--check`, which tests/test_mutation_list.py runs: a snippet that changed or was copied fails the
suite, so the list cannot silently rot; a module that moves keeps its mutants), and pytest runs the mutant's test files in the copy with this interpreter,
`-x`, and PYTHONPATH pointing at the copy. That makes the copy's paratrain the one imported: by
pytest, by the ranks `run_on_ranks` spawns and by `python -m paratrain run` subprocesses, which
inherit the environment; a probe checks both kinds of process before any mutant runs.

Caught: pytest failed (or ran past --timeout). Survived: every test passed, so the bug would go
unnoticed: add the test that catches it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "runs")


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what it stands for
    edits: tuple[tuple[str, str], ...]  # (exact snippet, replacement); each occurs once in paratrain/
    tests: tuple[str, ...]  # test files (or node ids) that must catch it


MUTANTS = [
    # the first table: DDP, ZeRO, the pipeline's schedules
    Mutant("ddp-world", "DDP averages over the world instead of its process group",
           (("self.world = dist.get_world_size(group)", "self.world = dist.get_world_size()"),),
           ("tests/parallel/test_ddp.py",)),
    Mutant("scaler-restore", "the fp16 loss scale is not restored by a resume",
           (("        session.scaler.load_state_dict(state[\"scaler\"])", "        pass"),),
           ("tests/session/test_resume.py", "tests/components/test_precision.py")),
    Mutant("zero2-slices-replace", "a second synchronised backward replaces ZeRO-2's gradient slice",
           (("add_into(self.shard_grads.get(bucket.index), mine)", "add_into(None, mine)"),),
           ("tests/parallel/zero/test_zero.py",)),
    Mutant("launch-at-finish", "buckets launch only when backward ends (no overlap)",
           (("        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending == 0:",
             "        while False:"),
            ("        \"\"\"Wait for every launched reduction.\"\"\"\n        self.reduction.finish()",
             "        for bucket in self.buckets[self.next_to_launch:]:\n"
             "            self.reduction.start(bucket)\n        self.reduction.finish()")),
           ("tests/parallel/test_ddp.py", "tests/parallel/pipeline/test_pipeline.py::"
            "test_a_replicated_stage_starts_each_full_buckets_all_reduce_while_backward_continues")),
    Mutant("1f1b-warmup", "1F1B's warm-up runs one forward too many",
           (("        w = min(p - 1 - s, m)\n        order = [Action(Op.F, i, s) for i in range(w)]\n        for i",
             "        w = min(p - s, m)\n        order = [Action(Op.F, i, s) for i in range(w)]\n        for i"),),
           ("tests/parallel/pipeline/test_pipeline.py",)),
    # our own, in recently written code
    Mutant("rebuild-own-order", "each rank rebuilds its buckets in its own arrival order",
           (("        if self.world > 1:\n            comm.broadcast(order, 0, self.group)",
             "        if False:\n            comm.broadcast(order, 0, self.group)"),),
           ("tests/parallel/test_ddp.py",)),
    Mutant("unused-not-settled", "a parameter used on another rank keeps no gradient here",
           (("        if self.find_unused:  # on every rank", "        if False:  # on every rank"),),
           ("tests/parallel/test_ddp.py",)),
    Mutant("aliased-no-average", "a gradient already in its bucket is not multiplied by 1/N",
           (("            if factor != 1.0:\n                view.mul_(factor)",
             "            if False:\n                view.mul_(factor)"),),
           ("tests/parallel/test_ddp.py", "tests/components/test_accumulation.py")),
    Mutant("grid-axes-swapped", "the grid's pipeline and data-parallel axes are swapped",
           (('COMPOSITE = {"dp": ("replicate", "shard")}', 'COMPOSITE = {"dp": ("pp",), "pp": ("replicate", "shard")}'),),
           ("tests/parallel/pipeline/test_pipeline.py",)),
    Mutant("zero2-keeps-full-grads", "ZeRO-2 keeps each bucket's full gradients after reducing them",
           (("            bucket.buffer.untyped_storage().resize_(0)  # the full gradients live only in backward",
             "            pass"),),
           ("tests/parallel/zero/test_zero_memory.py",)),
    Mutant("replicas-sync-every-microbatch", "pipeline replicas all-reduce on every micro-batch",
           (("            last = self._last_weights[a.stage] == a", "            last = True"),),
           ("tests/parallel/pipeline/test_pipeline.py",)),
    Mutant("interleaved-warmup", "interleaved 1F1B warms up one hop short per stage",
           (("w = min((v - 1) * n + 2 * (p - 1 - r), total)", "w = min((v - 1) * n + (p - 1 - r), total)"),),
           ("tests/parallel/pipeline/test_schedules.py",)),
    Mutant("replicas-sync-before-last-weight", "a chunk's replicas average at its first weight pass, not its last",
           (("self._last_weights = {a.stage: a for a in self.actions if a.op in (Op.B, Op.W)}",
             "self._last_weights = {a.stage: a for a in reversed(self.actions) if a.op in (Op.B, Op.W)}"),),
           ("tests/parallel/pipeline/test_pipeline.py",)),
    Mutant("hsdp12-slices-not-averaged-across-replicas", "hybrid ZeRO-2 keeps each group's own gradient slices",
           (("            across_replicas([mine], self.replicate)\n", ""),),
           ("tests/parallel/zero/test_hybrid.py",)),
    Mutant("hsdp12-buffers-stay-in-their-group", "hybrid ZeRO-1/2 broadcasts buffers within each group only",
           (("        if self.replicate_group is not None:  # and the first group's across the replicas\n"
             "            broadcast_coalesced(self.modules_buffers, self.replicate_group)\n", ""),),
           ("tests/parallel/zero/test_hybrid.py",)),
    Mutant("pp-zero-norm-over-one-replica", "a sharded pipeline clips by the norm of one replica's slices",
           (("            return self.sharded.grads(), self.holders", "            return self.sharded.grads(), self.pipe_group"),),
           ("tests/parallel/pipeline/test_pipeline_zero.py",)),
    Mutant("plan-hybrid-shards-over-world", "the planner shards hybrid ZeRO over the whole world",
           (("    shard = world // strategy.replicate\n", "    shard = world\n"),),
           ("tests/plan/cost/test_memory.py",)),
    Mutant("pp-zero-no-gather", "a sharded pipeline's replicas never receive each other's updated slices",
           (("        for owned in self.owned:\n            owned.gather()", "        pass"),),
           ("tests/parallel/pipeline/test_pipeline_zero.py",)),
    Mutant("mesh-pp-ignored-at-tp1", "Mesh(pp=...) with tp=1 runs DDP of the whole model, not the pipeline",
           (("        if self.pp is not None:  # the pipeline cuts the model; its replicas run `inner`",
             "        if False:"),),
           ("tests/parallel/pipeline/test_pipeline_zero.py",)),
    Mutant("pp-zero-first-chunk-only", "a sharded pipeline's optimizer steps the first chunk's slices only",
           (("        return [s for owned in self.owned for s in owned.shards]", "        return list(self.owned[0].shards)"),),
           ("tests/parallel/pipeline/test_pipeline_zero.py",)),
    Mutant("links-share-a-tag", "every pipeline link uses one p2p tag, so two links between a pair mix",
           (("self._tag_in, self._tag_out = 2 * stage, 2 * (stage + 1)", "self._tag_in, self._tag_out = 0, 0"),),
           ("tests/parallel/pipeline/test_pipeline.py",)),
    Mutant("checker-ignores-link-order", "the schedule checker does not match sends to receives in order",
           (("        if sends[key] != recvs[key]:", "        if sorted(sends[key]) != sorted(recvs[key]):"),),
           ("tests/parallel/pipeline/test_schedules.py",)),
    Mutant("weight-pass-misses-shared-params", "W steps only the parameters of the chunk's first layer",
           (("params = [p for p in self._chunk_params[a.stage // self.stages] if p.requires_grad]",
             "params = [p for p in self._chunk_params[a.stage // self.stages] if p.requires_grad][:1]"),),
           ("tests/parallel/pipeline/test_pipeline.py",)),
    Mutant("cut-block-args", "a cut's blocks do not get the block_args",
           (("args = tuple(self.cut.block_args(self.model, x)) if self.cut.block_args is not None else ()",
             "args = ()"),),
           ("tests/test_torchtitan.py",)),
    Mutant("auto-ckpt-moduledict", "activation_checkpointing='auto' skips a ModuleDict of blocks",
           (("isinstance(m, NEVER_CALLED) and len(m) > 1", "isinstance(m, nn.ModuleList) and len(m) > 1"),),
           ("tests/test_torchtitan.py",)),
    Mutant("root-init-reassigned", "a tensor the root's init assigns anew (freqs_cis) is not kept",
           (("original.detach().copy_(new.detach())", "pass"),),
           ("tests/test_torchtitan.py",)),
    Mutant("init-fn-others", "an init_fn's writes to other modules' tensors are lost silently",
           (("self._refuse_others(path, owner, writes.targets)", "pass"),),
           ("tests/test_torchtitan.py",)),
    Mutant("sync-bn-cpu", "torch's SyncBatchNorm on the CPU is let through setup",
           (("refuse_sync_batchnorm_off_gpu(uncompiled(model), self.device)", "pass"),),
           ("tests/session/test_sync_batchnorm.py",)),
    Mutant("python-rng-not-restored", "a resume leaves Python's random where it was",
           (("    random.setstate((version, tuple(internal), gauss))", "    pass"),),
           ("tests/session/test_resume.py",)),
    Mutant("loader-rng-after-draw", "a checkpoint saves the loader's generator after the pass drew from it",
           (("        return self.pass_generator if self.pass_generator is not None else self.generator.get_state()",
             "        return self.generator.get_state()"),),
           ("tests/session/test_resume.py",)),
    Mutant("position-counts-fetched", "the data position counts what the loader fetched, not what trained",
           (("self.sampler.state_dict(per_replica_samples=self.stepped * self.batch_size)",
             "self.sampler.state_dict()"),),
           ("tests/session/test_resume.py",)),
    Mutant("window-start-not-kept", "a checkpoint inside an accumulation records the loop as it is, not at the "
           "accumulation's start",
           (("    if optimizer_step and session.accumulate > 1:", "    if False:"),),
           ("tests/session/test_resume.py",)),
    # comm hooks, join(), streams, weights tied across pipeline stages
    Mutant("comm-hook-prescaled", "gradients enter a comm hook's bucket already divided (the hook divides again)",
           (("    prescale = False  # the hook divides", "    prescale = True  # the hook divides"),),
           ("tests/parallel/test_ddp_comm_hooks.py",)),
    Mutant("comm-hook-value-dropped", "a hook's reduced tensor that is not the bucket (a user's hook; torch's write into it) is "
           "never copied back",
           (("            bucket.buffer.copy_(value.reshape(-1))", "            pass"),),
           ("tests/parallel/test_ddp_comm_hooks.py",)),
    Mutant("join-divides-by-world", "under join() gradients are divided by the initial world, not the ranks "
           "still training, even when asked otherwise",
           (("    return lambda: int(_value(notified).item())", "    return None"),),
           ("tests/parallel/test_ddp_join.py",)),
    Mutant("stream-resume-from-start", "a resumed IterableDataset stream starts its pass again",
           (("            batch = row // self.batch_size - skip", "            batch = row // self.batch_size"),),
           ("tests/data/test_loaders.py",)),
    Mutant("rebuild-holds-two-layouts", "DDP's bucket rebuild allocates the new layout while the first one "
           "is still alive (a second gradient's worth of memory at its peak)",
           (("            self.buckets = None  # free the old layout first", "            pass  # free the old layout first"),),
           ("tests/parallel/test_ddp.py",)),
    Mutant("unit-never-called", "ZeRO-3 makes a ModuleList a unit, whose forward hooks never fire",
           (("            if not name or isinstance(module, NEVER_CALLED):", "            if not name:"),),
           ("tests/parallel/zero/test_zero.py",)),
    Mutant("tied-grads-not-summed", "the stages holding a tied weight each step with their own gradient",
           (("            dist.all_reduce(p.grad, group=group)", "            pass"),),
           ("tests/parallel/pipeline/test_pipeline_cut.py",)),
    Mutant("tied-norm-counted-twice", "a weight tied across stages counts once per copy in the clipping norm",
           (("        return {id(p) for p, here in zip(self.params, self.counted_here) if not here}",
             "        return set()"),),
           ("tests/parallel/pipeline/test_pipeline_cut.py",)),
    # loading weights, export, ZeRO 1/2 master shards
    Mutant("load-weights-own-offset", "a ZeRO-3 rank reads its box of a weights file from offset 0",
           (("shard.tensor.copy_(reader.read_box(found[name], shard.metadata.shard_offsets,",
             "shard.tensor.copy_(reader.read_box(found[name], [0] * len(shard.metadata.shard_offsets),"),),
           ("tests/checkpoint/test_load_weights.py",)),
    # checkpoints at the whole shape: boxes, tensor-parallel slices
    Mutant("box-whole-rows-start", "the whole rows of a flat piece are stored as if the piece began at a row",
           (("                    whole_from * inner - start))", "                    0))"),),
           ("tests/checkpoint/test_checkpoint.py",)),
    Mutant("tp-checkpoint-flat-unshifted", "a ZeRO shard of a tp slice is stored where slice 0 sits",
           (("    if cut is None:\n        return offsets\n", "    if True:\n        return offsets\n"),),
           ("tests/parallel/tensor/test_tensor_checkpoint.py",)),
    Mutant("tp-checkpoint-local-shape", "a tp slice is recorded at its own shape, not the whole's",
           (("        return replace(layout, shapes=shapes, slices=slices)",
             "        return replace(layout, slices=slices)"),),
           ("tests/parallel/tensor/test_tensor_checkpoint.py",)),
    Mutant("verify-slice-one-run", "verify reads a tp slice as if it began the whole parameter",
           (("    cut = layout.slices.get(name)\n    if cut is None:\n        return [(start, values)]",
             "    cut = layout.slices.get(name)\n    if True:\n        return [(start, values)]"),),
           ("tests/debug/test_verify.py::test_verify_checks_a_tensor_parallel_job_and_names_a_bug_in_a_slice",)),
    Mutant("load-weights-no-check", "a mis-shaped key is loaded as far as it goes, not refused",
           (("                      for k in keys if reader.shape(k) != tuple(shape)]",
             "                      for k in keys if False]"),),
           ("tests/checkpoint/test_load_weights.py",)),
    Mutant("export-no-aliases", "an export leaves out the other names of a tied weight",
           (("            for n in names:\n                writer.add(n, value)",
             "            for n in names[:1]:\n                writer.add(n, value)"),),
           ("tests/checkpoint/test_export.py",)),
    Mutant("masters-not-copied-back", "ZeRO-1/2 master shards are stepped but never copied into the parameters",
           (("                self._slice(buf).copy_(shard.detach())", "                pass"),),
           ("tests/parallel/zero/test_zero.py",)),
    Mutant("masters-regrad-each-call", "the master gradients are copied again at the step, losing the clipping",
           (("        if self.masters and self._grads_from == self._reduction.backwards:",
             "        if False:"),),
           ("tests/parallel/zero/test_zero.py",)),
    # this session: ZeRO-3's leaf per use, and ZeRO's finite check by sums
    Mutant("zero3-first-grad-dropped", "ZeRO-3 loses the gradient that arrives before its flat buffer exists",
           (("            span.copy_(arrived)", "            pass"),),
           ("tests/parallel/zero/test_zero.py",)),
    Mutant("zero3-reduce-at-first-use", "ZeRO-3 reduces a unit's gradient when its first use's gradient is in",
           (("        return self._arrived == len(self.leaves)", "        return self._arrived == 1"),),
           ("tests/parallel/zero/test_zero.py",)),
    Mutant("reduced-sums-always-finite", "the sums of whole reductions call every gradient finite",
           (("        if total is None or self.share is None:\n            return total\n",
             "        if total is None or self.share is None:\n            return None if total is None else torch.zeros(())\n"),),
           ("tests/session/test_finite_check.py",)),
    # verify
    Mutant("verify-rank-0-only", "paratrain verify checks a replicated parameter on the lowest rank only",
           (("    held = {r: pieces for r, pieces in candidate.items() if pieces}",
             "    held = {r: pieces for r, pieces in candidate.items() if pieces and r == min(candidate)}"),),
           ("tests/debug/test_verify.py::test_injected_bugs_are_named_with_their_step_parameter_and_rank",)),
    Mutant("meta-unset-silent", "a meta-built tensor no owner sets is left as garbage, unnamed",
           (("        if unset:\n            names =", "        if False:\n            names ="),),
           ("tests/components/test_materialize.py::test_a_tensor_that_no_owner_sets_is_named_not_left_as_garbage",)),
    Mutant("teardown-forgiven-running", "a job whose rank was still in its script counts as finished",
           (("    return all(e.kind == \"exit\" for e in ends.values()) and", "    return all(e.kind in (\"exit\", \"running\") for e in ends.values()) and"),),
           ("tests/launch/test_launcher_faults.py::test_a_teardown_crash_after_every_rank_finished_is_no_failure_of_the_job",)),
    Mutant("plan-ddp-no-overlap", "the planner charges DDP's whole all-reduce after the backward",
           (("        end = max(backward * done / total, end) + seconds", "        end = max(backward, end) + seconds"),),
           ("tests/plan/cost/test_step_time.py",)),
    Mutant("zero3-unused-stepped", "ZeRO-3 steps a parameter that got no gradient with a zero one",
           (("        if sync:  # [Note: no gradient] in flat_shard.py", "        if False:"),),
           ("tests/parallel/zero/test_zero.py::test_a_parameter_without_gradient_under_zero_is_named",)),
    Mutant("zero3-seen-per-backward", "ZeRO-3 forgets a gradient from an earlier micro-batch of the step",
           (("        self._arrived, self.flushed = 0, False", "        self._arrived, self.flushed, self.seen = 0, False, set()"),),
           ("tests/parallel/zero/test_zero.py::test_stage3_a_parameter_used_in_an_earlier_micro_batch_is_stepped_as_on_one_process",)),
    Mutant("zero3-gather-unchecked", "ZeRO-3 under debug_collectives lets ranks gather different units",
           (("        if self.gather_check is not None:  # [Note: the same unit on every rank] in collectives.py",
             "        if False:"),),
           ("tests/debug/test_desync.py::test_zero3_ranks_gathering_different_units_fail_naming_them",)),
    Mutant("zero3-root-held", "a tied root's part-way gradient is held through every other unit's backward",
           (("        if self._sync_this_backward and unit.name:\n            self._flush_partial(unit)",
             "        pass"),),
           ("tests/parallel/zero/test_zero_memory.py",)),
    Mutant("zero3-copy-first-grad", "a flat of one parameter copies its first gradient into a zeroed buffer",
           (("        return (len(self.slots) == 1 and self.padded", "        return False and (len(self.slots) == 1 and self.padded"),),
           ("tests/parallel/zero/test_zero_memory.py",)),
    Mutant("zero3-root-one-flat", "the root's big parameters share the root's one flat",
           (("alone=OWN_FLAT_ELEMENTS if wrapped and not name else None)", "alone=None)"),),
           ("tests/parallel/zero/test_zero_memory.py",)),
    Mutant("tied-unit-by-one-name", "a weight tied across units goes to one of its names' units, not to "
           "the unit that holds both",
           (("common = enclosing if common is None else common & enclosing",
             "common = enclosing if common is None else common | enclosing"),),
           ("tests/parallel/zero/test_zero_memory.py",)),
    Mutant("min-params-counts-wrapped", "min_params counts parameters a unit inside already holds "
           "(a module directly under the chosen one)",
           (("for m in enclosing_modules(n)))", "for m in enclosing_modules(n)[1:]))"),),
           ("tests/parallel/zero/test_zero_memory.py",)),
    Mutant("numpy-cache-ignores-gaussian", "the step's NumPy snapshot is reused while a cached gaussian "
           "may have been used since (no generator word moves)",
           (("reusable=lambda state: not state[3])", "reusable=lambda state: True)"),),
           ("tests/session/test_resume.py",)),
    Mutant("python-cache-ignores-gaussian", "the step's snapshot of Python's random is reused after its "
           "cached gaussian (gauss_next) was used",
           (("extra=lambda: random._inst.gauss_next)", "extra=lambda: None)"),),
           ("tests/session/test_resume.py",)),
    Mutant("restore-keeps-cache", "set_rng_state keeps the last snapshots after restoring other states",
           (("    _NUMPY.forget()\n    _PYTHON.forget()\n", "    pass\n"),),
           ("tests/session/test_resume.py",)),
    Mutant("step-holds-outputs", "train_step keeps the model's outputs (a GPT's logits) alive through backward",
           (("        del outputs\n", "        outputs = outputs\n"),),
           ("tests/session/test_session.py",)),
    Mutant("backward-under-autocast", "backward runs under the session's autocast (CUDA: extra casts per block)",
           (("    if first is None or not torch.is_autocast_enabled(first.device.type):", "    if True:"),),
           ("tests/session/test_session.py",)),
    Mutant("loss-check-dropped", "the step no longer reads the micro-batches' losses: a NaN loss is not named",
           (("    loss = losses.total() if check_finite and losses is not None else None", "    loss = None"),),
           ("tests/session/test_misuse.py",)),
    Mutant("loss-check-reduced-path", "where the reductions' sums answer the check, the losses are not read",
           (("        return reduced_finite if loss is None else reduced_finite + loss.to(reduced_finite.device)",
             "        return reduced_finite"),),
           ("tests/session/test_misuse.py",)),
    Mutant("loss-log-kept", "the losses read at a step stay in the log: it grows, and an old NaN is reported again",
           (("    finally:\n        if losses is not None:\n            losses.items.clear()",
             "    finally:\n        if losses is not None:\n            pass"),),
           ("tests/session/test_misuse.py",)),
    Mutant("destroy-no-drain", "destroy() drops its groups at once, a backend thread may hold the last one",
           (("    groups.clear()  # here", "    groups = []  # here"),
            ("    while any(sys.getrefcount(g) > 3 for g in groups)", "    while False and any(sys.getrefcount(g) > 3 for g in groups)")),
           ("tests/distributed/test_topology.py",)),
    Mutant("ddp-sums-nothing", "DDP's all-reduce never sums its buckets for the finite check",
           (("                self.sums.add(buffer)", "                pass"),),
           ("tests/session/test_finite_check.py",)),
    Mutant("shared-sums-no-flag", "a rank that summed only its share of DDP's buckets trusts its own share",
           (("        return sum_over(total, self.share[2])", "        return total"),),
           ("tests/session/test_finite_check.py",)),
    Mutant("shared-sums-whole", "each rank sums every bucket whole, and still all-reduces the sums",
           (("            flat = flat.tensor_split(world)[rank]", "            pass"),),
           ("tests/session/test_finite_check.py",)),
    # pipeline stages by their blocks (plan/model/block_regions.py)
    Mutant("plan-pipeline-equal-pace", "the planner's unequal pipeline stages run at the average stage's pace",
           (("    bubble = sum(per_slot) - per_slot[slowest]", "    bubble = (stages - 1) * per_slot[slowest]"),),
           ("tests/plan/cost/test_step_time.py",)),
    Mutant("plan-pipeline-no-backward-rest", "the last stage holds none of the backward's transient bytes",
           (("        extra = rest if s == strategy.stages - 1 else 0", "        extra = 0"),),
           ("tests/plan/model/test_probe.py",)),
    Mutant("zero-sums-whole", "above the limit each ZeRO rank sums every reduction whole, not its slice",
           (("    return ReducedSums((dist.get_rank(group), dist.get_world_size(group), group or dist.group.WORLD))",
             "    return ReducedSums()"),),
           ("tests/session/test_finite_check.py",)),
    Mutant("zero3-sums-unwatched", "ZeRO-3 sums every reduction for a plain pt.shard loop that checks nothing",
           (("        self._sums = None  # the finite check's ReducedSums, once watched (watch_reductions)",
             "        self._sums = reduced_sums_for(1 << 30, self.collectives.reduce_scatter, process_group)"),),
           ("tests/session/test_finite_check.py",)),
    # the finite check on the device (step.py, DeviceCheck)
    Mutant("device-check-no-found-inf", "a step checked on the device is taken whatever its flag says",
           (("    optimizer.found_inf = flag\n", "    optimizer.found_inf = None\n"),),
           ("tests/session/test_device_check.py",)),
    Mutant("device-check-never-read", "the flag of a step checked on the device is never read back",
           (("        if flag.item():\n", "        if False and flag.item():\n"),),
           ("tests/session/test_device_check.py",)),
    Mutant("sharded-found-inf-dropped", "ZeRO 1/2's optimizer does not hand found_inf to the one it steps",
           (("        self.inner.found_inf = getattr(self, \"found_inf\", None)\n",
             "        self.inner.found_inf = None\n"),),
           ("tests/session/test_device_check.py",)),
    Mutant("close-forgets-pending", "close() drops the last step's device check unread",
           (("        pending, self._on_device = self._on_device, None\n", "        pending, self._on_device = None, None\n"),),
           ("tests/session/test_device_check.py",)),
    # offload in the plan (step_time.offload, recommend.predict_time)
    Mutant("plan-offload-one-gather", "ZeRO-3 with offload copies its shards up once, not at every gather",
           (("gathers = 2 * accumulate if strategy.stage == 3 else 1", "gathers = 1"),),
           ("tests/cli/test_plan_cli.py",)),
    Mutant("plan-offload-device-step", "offload's optimizer step is timed on the device, not the host",
           (("            optimizer = host_step\n", ""),),
           ("tests/cli/test_plan_cli.py",)),
    # ZeRO-3's backward walked flat by flat (plan/cost/zero3_backward.py)
    Mutant("plan-zero3-no-copy", "the walk forgets autograd's gradient while it is copied into a flat's buffer",
           (("return self.full + (0 if self.adopts else self.arrived)", "return self.full"),),
           ("tests/plan/cost/test_zero3_backward.py",)),
    Mutant("plan-zero3-no-wait", "the walk forgets the previous flat's buffer, still reducing, as a gradient arrives",
           (("flat.arrived + (previous.full if previous else 0) + done", "flat.arrived + done"),),
           ("tests/plan/cost/test_zero3_backward.py",)),
    # the quick exit (cli.py [Note: a quick exit])
    Mutant("cli-freezes-callers", "cli.main freezes the objects of a process that called it, not only the command's",
           (("    if argv is None:  # this process is the `paratrain` command", "    if True:  #"),),
           ("tests/cli/test_cli.py::test_only_processes_paratrain_started_leave_their_imports_out_of_collection",)),
    Mutant("ranks-freeze", "every rank `paratrain run` starts freezes what exists when its script starts",
           (("    sys.modules[\"__main__\"] = main\n",
             "    sys.modules[\"__main__\"] = main\n    __import__('gc').freeze()\n"),),
           ("tests/cli/test_cli.py::test_script_runs_on_every_rank_with_its_arguments_unchanged",)),
    # the review of stop 39: what passed silently
    Mutant("ported-sampler-refused", "a ported DDP script's DistributedSampler is refused (or, before, replaced)",
           (("    if isinstance(sampler, (DistributedSampler, TorchDistributedSampler)):  # a ported DDP script's",
             "    if False:"),),
           ("tests/data/test_loaders.py::test_a_ported_scripts_distributed_sampler_keeps_its_shuffle_and_seed",)),
    Mutant("nan-step-keeps-grads", "a step the NaN check stopped leaves its gradients for the next one",
           (("    except UsageError:  # the loop may catch it and go on", "    except ZeroDivisionError:  #"),),
           ("tests/session/test_finite_check.py::test_a_loop_that_catches_a_bad_batch_goes_on_as_if_it_were_not_there",)),
    Mutant("find-unused-counted-twice", "a gradient arriving after find_unused sent its zero is reduced again",
           (("        if p in self._marked:", "        if False:"),),
           ("tests/parallel/test_ddp.py::test_find_unused_follows_a_dataclass_output_and_names_a_parameter_reached_another_way",)),
    Mutant("resumed-window-start-lost", "a resumed run's mid-window save records the half-trained micro-batch",
           (("    session.step_boundary = position(session) if session.accumulate > 1 else None",
             "    session.step_boundary = None"),),
           ("tests/checkpoint/test_checkpoint_safety.py::test_a_resumed_run_saving_mid_window_records_the_window_start",)),
    # a checkpoint reads only its own files (checkpoint_files.own_file)
    Mutant("checkpoint-reads-outside", "a checkpoint's metadata may point a tensor at any file the job can read",
           (("    path = ckpt / name\n", "    path = ckpt / name\n    return path\n"),),
           ("tests/checkpoint/test_checkpoint_traversal.py",)),
    # each rank `paratrain run` starts (launch/rank.py)
    Mutant("script-end-unnoted", "a rank's note says the script ended only when its exit handlers are done",
           (("    worker.script_ended()  # an exception instead", "    pass  # an exception instead"),),
           ("tests/launch/test_launcher_faults.py",)),
    # resume's words for what it skips or refuses
    Mutant("unmarked-checkpoint-silent", "a checkpoint without its marker is skipped with no warning",
           (("        for path in _unmarked(root):", "        for path in []:"),),
           ("tests/checkpoint/test_checkpoint_safety.py::test_a_checkpoint_without_its_marker_is_skipped_with_a_warning",)),
    Mutant("foreign-dataset-raw-advice", "a Session resuming another dataset gets the raw sampler's advice",
           (("    _check_same_dataset(session, state.get(\"sampler\"), path)\n", ""),),
           ("tests/checkpoint/test_checkpoint_safety.py::"
            "test_resuming_with_another_dataset_says_what_a_session_user_can_do",)),
    # tensor parallelism (parallel/tensor/) and the grid it lives on
    Mutant("tp-f-no-backward-reduce", "a column-parallel layer's input gradient is not summed over tp",
           (("        dist.all_reduce(grad, group=ctx.group)\n", ""),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-g-no-forward-reduce", "a row-parallel layer's partial products are not summed over tp",
           (("        dist.all_reduce(x, group=group)  # in place", "        pass  # in place"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-rowwise-bias-each-rank", "a row-parallel layer adds its bias before the sum, once per tp rank",
           (("        y = self._reduce(F.linear(x, self.weight))",
             "        return self._reduce(F.linear(x, self.weight, self.bias))"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-vocab-rows-unmasked", "a vocabulary-parallel embedding sums rows of ids outside its range",
           (("        return self._reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))",
             "        return self._reduce(rows)"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-clip-counts-replicated-on-each", "the clipping norm counts a replicated parameter once per tp rank",
           (("name in self.shard_dims or self.tp_rank == 0", "name in self.shard_dims or True"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-f-per-layer", "q, k and v each all-reduce their shared input's gradient (three messages, not one)",
           (("    out = _last.get(x, group)\n", "    out = None\n"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("plan-tp-cut-first-dim", "the planner cuts every layer's first dimension (a row-parallel one splits its second)",
           (("                shape[dim] //= strategy.tp", "                shape[0] //= strategy.tp"),),
           ("tests/plan/cost/test_memory.py::test_tensor_parallel_prediction_equals_the_bytes_each_rank_holds",)),
    Mutant("plan-zero3-copies-all-checkpointed", "checkpointed ZeRO-3 is charged every weight's autocast copy, not one unit's",
           (("    if copies and m.step is not None and m.step.checkpointed:", "    if False:"),),
           ("tests/plan/cost/test_memory.py::test_autocasts_weight_copies_are_what_each_rank_holds_through_a_bf16_step",)),
    Mutant("plan-copies-as-activations", "the probe counts autocast's weight copies in the batch's transient bytes",
           (("if ref not in self.alive and ref not in self.ignore and ref not in self.copy_storages:",
             "if ref not in self.alive and ref not in self.ignore:"),),
           ("tests/plan/model/test_probe.py::test_the_weight_copies_are_not_in_the_transient_bytes",)),
    Mutant("pipeline-llama-eager-no-mask", "a Llama stage under eager attention runs its blocks without the causal mask",
           (("    if getattr(config, \"_attn_implementation\", \"sdpa\") == \"eager\":", "    if False:"),),
           ("tests/parallel/pipeline/test_pipeline_cut.py::test_transformers_llama_shaped_decoders_train_on_stages",)),
    Mutant("pipeline-cut-every-ignored", "the parts every stage must keep go to the first or last stage only",
           (("    everywhere = [_entry(model, n) for n in cut.every]", "    everywhere = []"),),
           ("tests/parallel/pipeline/test_pipeline_cut.py::test_transformers_llama_shaped_decoders_train_on_stages",)),
    Mutant("verify-reference-stale", "verify reuses a kept reference run after the script changed",
           (("        if json.loads(note.read_text()) == what:", "        if True:"),),
           ("tests/debug/test_verify.py::test_token_weighted_losses_are_compared_over_every_token",)),
    Mutant("session-hooks-after-step-first-only", "only the first step hook hears that an optimizer step ended",
           (('        for call in self._of["after_step"]:', '        for call in self._of["after_step"][:1]:'),),
           ("tests/session/test_hooks.py",)),
    Mutant("plan-search-no-param-dtype", "the search never tries ZeRO with param_dtype under autocast",
           (('                        if low is not None and dp != "ddp":', '                        if False:'),),
           ("tests/plan/test_search.py",)),
    Mutant("plan-tp-free-all-reduces", "the planner's tp step leaves out the all-reduces of the layers",
           (("    return accumulate * per_block * sum(", "    return 0 * per_block * sum("),),
           ("tests/plan/cost/test_tensor_parallel.py",)),
    Mutant("plan-tp-pp-every-block", "a pipeline's tp rank is charged the all-reduces of every stage's blocks",
           (("recompute=bool(step.checkpointed), cluster=cluster) / stages", "recompute=bool(step.checkpointed), cluster=cluster)"),),
           ("tests/plan/cost/test_tensor_parallel.py",)),
    Mutant("plan-tp-pp-bubble", "the tp all-reduces do not stretch a pipeline's bubble slots",
           (("    bubble = inner.bubble * share * (1 + comm / compute) if compute else inner.bubble",
             "    bubble = inner.bubble * share if compute else inner.bubble"),),
           ("tests/plan/cost/test_tensor_parallel.py",)),
    Mutant("plan-stage-replicas-one-node", "a pipeline stage's replicas are planned inside one node wherever they are",
           (("    return Group(replicas, spread(replicas, max(1, gpus // nodes)))", "    return Group(replicas)"),),
           ("tests/plan/cost/test_tensor_parallel.py",)),
    Mutant("plan-1f1b-holds-p", "the planner's 1F1B holds p micro-batches on every stage",
           (("tuple(min(m, p - s) for s in range(p))", "tuple(min(m, p) for s in range(p))"),),
           ("tests/plan/cost/test_schedule_figures.py",)),
    Mutant("plan-search-slowest-first", "the search ranks the slowest layouts first",
           (('    found.sort(key=lambda row: -row["per_device_per_second"])',
             '    found.sort(key=lambda row: row["per_device_per_second"])'),),
           ("tests/plan/test_search.py",)),
    Mutant("plan-reused-any-strategy", "the search reuses one strategy's layout for another's",
           (("return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)",
             "return value if isinstance(value, (int, float, str, bool, type(None))) else None"),),
           ("tests/plan/test_search.py",)),
    Mutant("tp-pp-holders", "a pipeline of tp stages sums its clipping norm over its tp group only",
           (('grid.group("pp" if self.pp is not None else "shard" if grid.replicate > 1 else "dp", "tp")',
             'grid.group("shard" if grid.replicate > 1 else "dp", "tp")'),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-outermost", "the grid puts tp outermost, across nodes, instead of on adjacent ranks",
           (('LOGICAL = ("pp", "replicate", "shard", "cp", "tp")', 'LOGICAL = ("tp", "pp", "replicate", "shard", "cp")'),),
           ("tests/distributed/test_grid.py",)),
    Mutant("sp-whole-grads-not-summed", "under sequence parallelism a norm's weight steps on its rank's part only",
           (("        dist.all_reduce(grad, group=self.group)\n        return grad", "        return grad"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("sp-rowwise-bias-not-summed", "a row-parallel bias added on the sequence's parts is not summed over tp",
           (("                if not inside(name) and not cut_here or isinstance(m, RowwiseLinear) and pname == \"bias\":",
             "                if not inside(name) and not cut_here:"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("sp-gather-backward-keeps-slice", "a block's gathered input passes back its own part, not the sum",
           (("    return all_gather_with_grad(x, group, SEQ)", "    return _Gather.apply(x, group, SEQ)"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("lp-max-per-rank", "the vocab-parallel cross-entropy shifts each slice by its own max",
           (("        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)\n", ""),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("lp-no-one-hot", "the vocab-parallel cross-entropy's gradient leaves out the target's −1",
           (("        out[rows, local[rows]] -= 1.0", "        pass"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("hsdp-no-replica-reduce", "hybrid sharding never sums a gradient slice across the replicas",
           (("        if self.replicate_group is not None:  # the other replicas' sums of this same slice\n"
             "            dist.all_reduce(mine, group=self.replicate_group)\n", ""),),
           ("tests/parallel/zero/test_hybrid.py",)),
    Mutant("hsdp-mean-over-shard", "hybrid sharding averages over its shard group only (replicas summed)",
           (("        grad.div_(self.world * self.replicate)", "        grad.div_(self.world)"),),
           ("tests/parallel/zero/test_hybrid.py",)),
    Mutant("hsdp-tp-holders-with-replicas", "tp over hybrid sharding counts each replica's shard in the clipping norm",
           (('grid.group("pp" if self.pp is not None else "shard" if grid.replicate > 1 else "dp", "tp")',
             'grid.group("pp" if self.pp is not None else "dp", "tp")'),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("hierarchical-mesh-inter-is-intra", "under a mesh, hierarchical's cross-node groups are its node groups again",
           (("                inter += [list(column) for column in zip(*nodes.values())]",
             "                inter += nodes.values()"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("tp-dp-over-world", "data parallelism under a mesh averages over the world, tp ranks included",
           (("        return None if len(ranks) == self.topology.world_size else group", "        return None"),),
           ("tests/parallel/tensor/test_tensor_parallel.py",)),
    Mutant("zero3-buffers-drift", "ZeRO-3 never broadcasts rank 0's buffers before a forward",
           (("        if self.require_forward_param_sync:\n            self.sync_buffers()\n", ""),),
           ("tests/session/test_buffers.py",)),
    Mutant("state-dict-buffers-unsynced", "full_state_dict reports each rank's own buffers",
           (("        self.sync_buffers()\n        return {k: v for piece in self.state_pieces()",
             "        return {k: v for piece in self.state_pieces()"),),
           ("tests/session/test_buffers.py",)),
    Mutant("meta-unset-floats-only", "the materialise check refuses only unset floating-point tensors",
           (("    return t.is_floating_point() or t.is_complex()", "    return t.is_floating_point()"),),
           ("tests/components/test_materialize.py",)),
    Mutant("verify-loss-unweighted", "verify averages token-weighted losses without their weights",
           (('    if all(r.get("weight") is not None for r in records):', "    if False:"),),
           ("tests/debug/test_verify.py",)),
    # context parallelism (parallel/context/)
    Mutant("cp-contiguous-cut", "each rank holds a contiguous part of the sequence, not a chunk and its mirror",
           (("    return rank, 2 * cp - 1 - rank", "    return 2 * rank, 2 * rank + 1"),),
           ("tests/parallel/context/test_ring_attention.py",)),
    Mutant("cp-ring-no-lse-merge", "ring attention adds block outputs without weighing them by their log-sum-exp",
           (("    return out * torch.exp(lse.unsqueeze(-1) - both) + block_out * torch.exp(block_lse.unsqueeze(-1) - both), both[..., 0]",
             "    return out + block_out, both[..., 0]"),),
           ("tests/parallel/context/test_ring_attention.py",)),
    Mutant("cp-dkv-not-returned", "the ring's dK/dV accumulators stop one rank short of their owner",
           (("            grad_kv = passing.wait()  # this rank's own block, with every rank's share",
             "            passing.wait()"),),
           ("tests/parallel/context/test_ring_attention.py",)),
    Mutant("cp-loss-unweighed", "each cp rank's loss is its local mean, unweighed by its share of the tokens",
           (("        weighted = loss_fn if share is None else", "        weighted = loss_fn if True else"),),
           ("tests/parallel/context/test_context_parallel.py",)),
    Mutant("cp-local-positions", "torch.arange(local length) inside the step gives local positions",
           (("            return self.cut.positions(kwargs.get(\"device\")).to(kwargs.get(\"dtype\") or torch.int64)",
             "            return func(*args, **kwargs)"),),
           ("tests/parallel/context/test_context_parallel.py",)),
    Mutant("cp-ring-late-half", "a higher rank's block is seen by the first half of the queries, not the second",
           (("    return (ALL, slice(0, half), False) if owner < rank else (slice(half, None), ALL, False)",
             "    return (ALL, slice(0, half), False) if owner < rank else (slice(0, half), ALL, False)"),),
           ("tests/parallel/context/test_ring_attention.py",)),
    Mutant("plan-cp-forward-only", "the planner counts the ring's forward passes and none of backward's",
           (("    return (cp - 1) * (2 if recompute else 1) + 2 * cp - 1", "    return (cp - 1) * (2 if recompute else 1)"),),
           ("tests/plan/cost/test_context_parallel.py",)),
    Mutant("cp-all-gather-local-mask", "all-gather attention masks the gathered keys by local, not global, positions",
           (("        mask = theirs[None, :] <= mine[:, None]  # (L, S)",
             "        mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(local, device=q.device)[:, None]"),),
           ("tests/parallel/context/test_ring_attention.py",)),
]


def _sources(root: Path) -> dict[Path, str]:
    return {path: path.read_text() for path in sorted((root / "paratrain").rglob("*.py"))}


def locate(mutant: Mutant, sources: dict[Path, str]) -> list[tuple[Path | None, str, str]]:
    """(file, snippet, replacement) for each edit: the one file of the package that holds the snippet,
    or None where no file or several do. Mutants are keyed by what the code says, not by where it
    sits, so a module that moves or is renamed keeps its mutants."""
    out = []
    for old, new in mutant.edits:
        holders = [(path, text.count(old)) for path, text in sources.items() if old in text]
        one = len(holders) == 1 and holders[0][1] == 1
        out.append((holders[0][0] if one else None, old, new))
    return out


def check(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """Problems with the list: a snippet found nowhere in the package, or more than once."""
    sources, problems = _sources(root), []
    for m in mutants:
        for path, old, _ in locate(m, sources):
            if path is None:
                copies = sum(text.count(old) for text in sources.values())
                problems.append(f"{m.name}: paratrain/ holds {copies} copies of {old.strip()[:70]!r} "
                                "(needs exactly 1): update MUTANTS in tools/mutation_check.py")
    return problems


def apply(mutant: Mutant, root: Path) -> None:
    for path, old, new in locate(mutant, _sources(root)):
        path.write_text(path.read_text().replace(old, new))


def copy_tree(into: Path) -> Path:
    repo = into / "repo"
    shutil.copytree(ROOT, repo, ignore=IGNORED)
    return repo


def _env(repo: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")


PROBE = '''
import paratrain
from paratrain.testing import run_on_ranks

def where(topo):
    import paratrain
    return paratrain.__file__

if __name__ == "__main__":
    print(paratrain.__file__)
    for path in run_on_ranks(where, 2):
        print(path)
'''


def probe(repo: Path) -> None:
    """Fail unless this process's child and its spawned ranks import the copy's paratrain."""
    (repo / "mutation_probe.py").write_text(PROBE)
    done = subprocess.run([sys.executable, "mutation_probe.py"], cwd=repo, env=_env(repo),
                          capture_output=True, text=True, timeout=120)
    paths = done.stdout.split()
    if done.returncode or len(paths) != 3 or not all(p.startswith(str(repo)) for p in paths):
        raise SystemExit(f"the copy's paratrain is not the one imported: {paths}\n{done.stderr[-2000:]}")
    (repo / "mutation_probe.py").unlink()


def run_tests(repo: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, str, float]:
    """(caught | survived | timeout, the first failing test or '', seconds)."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"ran past {timeout:.0f} s", time.monotonic() - start
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    status = "survived" if done.returncode == 0 else "caught"
    return status, failed.group(1) if failed else "", time.monotonic() - start


def run_mutant(mutant: Mutant, timeout: float) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        repo = copy_tree(Path(tmp))
        apply(mutant, repo)
        return run_tests(repo, mutant.tests, timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--check", action="store_true", help="only check the snippets")
    parser.add_argument("--baseline", action="store_true", help="first run the tests on the unmutated copy")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; choose from {[m.name for m in MUTANTS]}")
    mutants = [m for m in MUTANTS if not args.names or m.name in args.names]
    problems = check(mutants)
    if problems or args.check:
        print("\n".join(problems) or f"all {len(mutants)} mutants' snippets occur exactly once")
        return 1 if problems else 0
    with tempfile.TemporaryDirectory(prefix="mutant-probe-") as tmp:
        repo = copy_tree(Path(tmp))
        probe(repo)
        if args.baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            status, failed, seconds = run_tests(repo, tests, timeout=4 * args.timeout)
            print(f"baseline (unmutated): {'passed' if status == 'survived' else status + ' ' + failed} "
                  f"in {seconds:.0f} s", flush=True)
            if status != "survived":
                return 1
    print("| mutant | bug | tests run | result | first failing test | seconds |\n| --- | --- | --- | --- | --- | --- |")
    survived = 0
    for m in mutants:
        status, failed, seconds = run_mutant(m, args.timeout)
        survived += status == "survived"
        print(f"| {m.name} | {m.bug} | {', '.join(t.removeprefix('tests/') for t in m.tests)} | {status} | "
              f"{failed.removeprefix('tests/')} | {seconds:.0f} |", flush=True)
    print(f"{len(mutants) - survived} of {len(mutants)} caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
