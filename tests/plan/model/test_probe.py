"""plan/model/probe.py and plan/model/source.py against counts derived by hand.

FLOPs are 2 per multiply-add of a matmul (FlopCounterMode's convention); bytes are float32 (4)
unless said. B: batch, T: sequence, C: width.
"""

import dataclasses
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import ModelSource, resolve

B, T, C, HEADS = 3, 16, 32, 4


def source(factory, name="test") -> ModelSource:
    def build():
        with torch.device("meta"):
            return factory()
    return ModelSource(name=name, build=build)


class Stack(nn.Sequential):
    """in → h → h → out, tanh between: Linear(in, h), Tanh, Linear(h, h), Tanh, Linear(h, out)."""

    def __init__(self, sizes=(8, 16, 16, 4), input_grad=False):
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        super().__init__(*layers[:-1])
        self.sizes, self.input_grad = sizes, input_grad

    def example_inputs(self, batch, seq):
        return (torch.zeros(batch, self.sizes[0], requires_grad=self.input_grad),)


@pytest.mark.parametrize("input_grad", [False, True])
def test_linear_stack_flops_are_2_B_in_out_per_layer_and_twice_that_backward(input_grad):
    """Forward: 2·B·in·out per layer. Backward: the weight's gradient (2·B·in·out) and the input's
    (2·B·in·out) per layer, except the first layer's input gradient when the input needs none."""
    sizes = (8, 16, 16, 4)
    facts = model_facts(source(lambda: Stack(sizes, input_grad)), B, activation_checkpointing=None)
    per_layer = [2 * B * a * b for a, b in zip(sizes, sizes[1:])]
    assert facts.step.flops_forward == sum(per_layer)
    assert facts.step.flops_backward == 2 * sum(per_layer) - (0 if input_grad else per_layer[0])
    assert facts.params == sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    assert facts.param_bytes == 4 * facts.params and facts.tokens == B


@pytest.mark.parametrize("input_grad", [False, True])
def test_linear_stack_matmuls_by_shape_mark_the_batch_dimension(input_grad):
    """Forward: (B × in) @ (in × out) per layer, m the batch. Backward per layer: the input's
    gradient (B × out) @ (out × in), m the batch, except the first layer's when the input needs
    none; the weight's (out × B) @ (B × in), k the batch. Their FLOPs are FlopCounterMode's."""
    from paratrain.plan.model.matmuls import Matmul, flops

    sizes = (8, 16, 16, 4)
    step = model_facts(source(lambda: Stack(sizes, input_grad)), B, activation_checkpointing=None).step
    m, k = (False, True, False, False), (False, False, True, False)
    expected = [Matmul("forward", 1, B, a, b, m) for a, b in zip(sizes, sizes[1:])]
    expected += [Matmul("backward", 1, b, B, a, k) for a, b in zip(sizes, sizes[1:])]
    expected += [Matmul("backward", 1, B, b, a, m) for a, b in list(zip(sizes, sizes[1:]))[0 if input_grad else 1:]]
    got = [shape for shape, count in step.matmuls for _ in range(count)]
    assert sorted(got) == sorted(expected)
    assert (flops(step.matmuls, "forward"), flops(step.matmuls, "backward")) == (step.flops_forward, step.flops_backward)
    assert expected[0].at(1 / 3) == (1, 1, 8, 16)  # a third of the batch: one row


def test_the_other_ops_move_their_inputs_and_outputs_and_the_batch_part_is_told_apart():
    """Forward of the stack: the matmuls move nothing here (their FLOPs time them), each tanh reads
    and writes B·16 floats, and the loss (a sum of the outputs) reads B·4 floats and writes one,
    which Python's sum() then adds to 0 (one float read, one written): all of it proportional to
    the batch but those three floats."""
    step = model_facts(source(Stack), B, activation_checkpointing=None).step
    assert step.traffic.forward_fixed == 3 * 4
    assert step.traffic.forward_per_batch == 2 * (2 * B * 16 * 4) + B * 4 * 4
    assert step.traffic.bytes("forward", 1 / 3) == 3 * 12 + step.traffic.forward_per_batch  # one row at a time
    assert step.traffic.backward_per_batch > 0


def test_an_embedding_moves_the_rows_it_gathers_not_its_table():
    """A 10,000 × 8 table (320 KB) looked up at B × 4 indices: it reads and writes B·4·8 floats
    and reads the B·4 int64 indices; the loss then reads them once more."""
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10_000, 8)

        def forward(self, idx):
            return self.table(idx)

        def example_inputs(self, batch, seq):
            return (torch.zeros(batch, 4, dtype=torch.long),)

    traffic = model_facts(source(Lookup), B, activation_checkpointing=None).step.traffic
    rows = B * 4 * 8 * 4
    assert traffic.forward_per_batch == 2 * rows + B * 4 * 8 + rows  # gather, indices, the loss's sum
    assert traffic.forward_fixed == 3 * 4  # the loss's one float, added to 0


def test_linear_stack_activation_bytes_are_its_inputs_and_tanh_outputs():
    """Linear saves its input (and its weight: a parameter, not counted); tanh saves its output,
    which the next Linear saves too: one storage. So: x (B·in) + two tanh outputs (B·h each)."""
    facts = model_facts(source(Stack), B, activation_checkpointing=None)
    assert facts.step.activation_bytes == 4 * (B * 8 + 2 * B * 16)


def test_under_bf16_autocast_the_saved_bytes_are_halved_and_the_weight_copies_are_counted_apart():
    """Autocast saves bf16 copies: the input cast (B·in) and the tanh outputs (bf16 already), 2
    bytes each. It casts every weight and bias a Linear uses, once (its cache): those copies are
    counted apart, whatever the batch and whether or not checkpointed backward casts again, and
    neither the saved nor the transient bytes hold them."""
    params = 8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4
    for batch in (B, 2 * B):
        bf16 = model_facts(source(Stack), batch, precision="bf16", activation_checkpointing=nn.Linear)
        fp32 = model_facts(source(Stack), batch, activation_checkpointing=nn.Linear)
        assert bf16.step.activation_bytes == 2 * (batch * 8 + 2 * batch * 16)
        assert bf16.step.weight_copy_bytes == bf16.checkpointed.weight_copy_bytes == 2 * params
        assert fp32.step.weight_copy_bytes == 0


def test_the_weight_copies_are_not_in_the_transient_bytes():
    """Frozen weights far larger than the activations: backward makes no weight gradient, so what
    it holds at once is activations and their gradients, a small part of the copies."""
    def frozen():
        model = Stack(sizes=(8, 256, 256, 4), input_grad=True)
        return model.requires_grad_(False)
    facts = model_facts(source(frozen), B, precision="bf16", activation_checkpointing=None)
    assert facts.step.weight_copy_bytes == 2 * sum(p.numel() for p in frozen().parameters())
    assert 0 < facts.step.transient_bytes < facts.step.weight_copy_bytes / 10


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):  # (B, T, C)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """x + attention(LN(x)), then x + MLP(LN(x)), as examples/gpt.py."""

    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(C), Attention(), nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers=4, vocab=50):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(C), nn.Linear(C, vocab, bias=False)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def block_flops() -> tuple[int, int]:
    """One block, forward, per token: qkv 2·C·3C, proj 2·C·C, MLP 2·(C·4C + 4C·C): 24·C² in all;
    attention QKᵀ and (scores)V: 2·T·C each (all T keys: FlopCounterMode does not halve causal
    attention): 4·T·C. Backward: every Linear twice its forward (48·C²: LayerNorm's weight makes the
    Linears' inputs need gradients); a fused attention's backward recomputes the scores and makes
    four more products: 5 · 2·T·C = 10·T·C."""
    forward = B * T * (24 * C * C + 4 * T * C)
    backward = B * T * (48 * C * C + 10 * T * C)
    return forward, backward


def test_a_gpt_block_costs_the_analytic_count():
    class One(Block):
        def example_inputs(self, batch, seq):
            return (torch.zeros(batch, seq, C),)

    facts = model_facts(source(One), B, T, activation_checkpointing=None)
    assert (facts.step.flops_forward, facts.step.flops_backward) == block_flops()


def test_checkpointing_keeps_each_blocks_input_and_recomputes_its_forward():
    """Checkpointed, a block saves its input only (B·T·C floats), and backward runs its forward
    again, up to the last tensor backward needs (torch.utils.checkpoint's early stop): all of it
    but the MLP's last Linear (2·4C·C per token), whose output nothing saves."""
    facts = model_facts(source(GPT), B, T)
    plain, ckpt = facts.step, facts.checkpointed
    assert ckpt.checkpointed == tuple(f"blocks.{i}" for i in range(4))
    assert ckpt.block_activation_bytes == {f"blocks.{i}": 4 * B * T * C for i in range(4)}
    assert ckpt.activation_bytes < plain.activation_bytes
    assert plain.activation_bytes - ckpt.activation_bytes == sum(plain.block_activation_bytes.values()) \
        - sum(ckpt.block_activation_bytes.values())
    assert ckpt.flops_forward == plain.flops_forward
    assert ckpt.flops_backward == plain.flops_backward + 4 * (block_flops()[0] - B * T * 8 * C * C)


def test_a_checkpointed_stack_holds_one_blocks_recompute_at_a_time():
    """Checkpointed, each more block adds its saved input (B·T·C floats) to the transient peak and
    nothing else: backward recomputes one block, uses it and lets it go before the next. (Counting
    FLOPs with FlopCounterMode kept every recomputed block alive to the end of backward.)"""
    four, eight = (model_facts(source(lambda: GPT(layers=n)), B, T).checkpointed for n in (4, 8))
    assert eight.transient_bytes - four.transient_bytes == 4 * (4 * B * T * C)
    assert eight.flops_backward > four.flops_backward > 0


def test_each_blocks_forward_flops_and_what_runs_before_and_after_them_are_counted_apart():
    """The embeddings before the blocks make no matmul; each block costs block_flops()'s forward;
    after the blocks, the head: 2·B·T·C·vocab. What is saved before the blocks (the token and
    position indices the embeddings' backward reads) is the lead's, and a pipeline stage's shares
    follow its blocks (block_regions.stage_shares): two blocks and the lead on the first, two
    and the head on the last."""
    from paratrain.plan.model.block_regions import stage_shares
    model = source(GPT).build()
    step = model_facts(source(GPT), B, T, activation_checkpointing=None).step
    assert step.lead_flops == 0
    assert step.block_flops == {f"blocks.{i}": block_flops()[0] for i in range(4)}
    assert step.flops_forward - sum(step.block_flops.values()) == 2 * B * T * C * 50
    assert 0 < step.lead_activation_bytes < min(step.block_activation_bytes.values())
    first = [*model.tokens.parameters(), *model.positions.parameters(), *model.blocks[:2].parameters()]
    last = [*model.blocks[2:].parameters(), *model.ln.parameters(), *model.head.parameters()]
    flops, saved = stage_shares(step, model, [first, last])
    assert flops[0] == pytest.approx(2 * block_flops()[0] / step.flops_forward)
    assert flops[1] == pytest.approx((2 * block_flops()[0] + 2 * B * T * C * 50) / step.flops_forward)
    blocks = step.block_activation_bytes
    assert saved[0] == pytest.approx((step.lead_activation_bytes + blocks["blocks.0"] + blocks["blocks.1"])
                                     / step.activation_bytes)
    assert sum(saved) == pytest.approx(1.0) and saved[1] > saved[0]
    assert stage_shares(step, model, [first]) is None  # blocks 2 and 3 on no stage: split evenly


def test_a_pipelines_stages_split_the_activations_by_their_blocks_and_lose_none():
    """GPipe holds every micro-batch on every stage. Split evenly, the stages' activations add up
    to the transient peak; split by the stages' blocks (memory._pipeline), to the saved
    activations, all of them, and the rest of the peak (the backward's gradients and
    temporaries) once, for one of the 3 micro-batches, on the last stage, which holds more."""
    import paratrain as pt
    from paratrain.plan.cost.memory import predict

    step = model_facts(source(GPT), B, T, activation_checkpointing=None).step
    cut = pt.Cut("blocks", embed=lambda m, idx: m.tokens(idx) + m.positions(torch.arange(idx.shape[1])),
                 head=lambda m, x: m.head(m.ln(x)))
    pipe = pt.Pipeline(stages=2, microbatches=3, schedule="gpipe", cut=cut)
    even = predict(source(GPT).build(), pipe, world=2, activation_bytes=step.activation_peak_bytes)
    split = predict(source(GPT).build(), pipe, world=2, activation_bytes=step.activation_peak_bytes, step=step)
    assert even[0].activations == even[1].activations
    rest = step.activation_peak_bytes - step.activation_bytes
    assert sum(r.activations for r in split) == pytest.approx(step.activation_bytes + rest / 3, abs=2)
    assert sum(r.activations for r in even) == pytest.approx(step.activation_peak_bytes, abs=2)
    assert split[1].activations > split[0].activations


@pytest.mark.slow
def test_a_stack_counted_from_one_and_two_blocks_equals_the_whole_count():
    shortcut = model_facts(source(lambda: GPT(layers=5)), B, T)
    whole = model_facts(source(lambda: GPT(layers=5)), B, T, exact=True)
    assert shortcut.notes and not whole.notes
    assert shortcut.step.extended and shortcut.checkpointed.extended and not whole.step.extended
    same = lambda a, b: dataclasses.replace(a, extended=False) == b  # noqa: E731
    assert same(shortcut.step, whole.step) and same(shortcut.checkpointed, whole.checkpointed)


@pytest.mark.slow
def test_a_forward_that_picks_blocks_by_index_is_counted_whole():
    class ByIndex(GPT):
        def forward(self, idx):
            x = self.tokens(idx)
            for i in range(4):
                x = self.blocks[i](x)
            return self.head(self.ln(x))

    facts = model_facts(source(ByIndex), B, T)
    assert not facts.step.extended and not facts.notes
    assert facts.step == model_facts(source(ByIndex), B, T, exact=True).step


def test_presets_have_the_published_sizes():
    """GPT-2: V·C + P·C (embeddings; the head is tied) + L·(12·C² + 13·C) + 2·C (final LN).
    Llama: 2·V·C (untied) + L·(2·C² + 2·C·kv_heads·C/heads + 3·C·I + 2·C) + C (RMS norms)."""
    def gpt2(layers, width):
        return 50257 * width + 1024 * width + layers * (12 * width ** 2 + 13 * width) + 2 * width

    def llama(vocab, width, inter, layers, heads, kv):
        attention = 2 * width ** 2 + 2 * width * kv * (width // heads)
        return 2 * vocab * width + layers * (attention + 3 * width * inter + 2 * width) + width

    assert resolve("gpt2").build().num_parameters() == gpt2(12, 768)
    assert resolve("gpt2-xl").build().num_parameters() == gpt2(48, 1600)
    assert resolve("llama-2-7b").build().num_parameters() == llama(32000, 4096, 11008, 32, 32, 32)
    assert resolve("llama-3-70b").build().num_parameters() == llama(128256, 8192, 28672, 80, 64, 8)


COUNT_70B = """
import resource, sys
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import resolve
model_facts(resolve("llama-2-70b"), 1, 4096, precision="bf16")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_llama_2_70b_is_counted_without_memory():
    """On fake tensors: the process that counts it peaks far below the model's 138 GB in bf16
    (bytes, not seconds: a count a loaded machine cannot fail)."""
    done = subprocess.run([sys.executable, "-c", COUNT_70B], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 2 * 2**30
    facts = model_facts(resolve("llama-2-70b"), 1, 4096, precision="bf16")
    # forward ≥ 2 FLOPs per parameter of the matmuls per token (the input embedding does none)
    matmul_params = facts.params - 32000 * 8192
    assert facts.step.flops_forward >= 2 * matmul_params * 4096
    assert facts.checkpointed.activation_bytes < facts.step.activation_bytes / 10


def test_bad_models_get_one_clear_error(tmp_path, monkeypatch):
    module = types.ModuleType("plan_bad_models")
    module.broken = lambda: 1 / 0
    module.not_a_model = lambda: "hello"
    module.conv = lambda: nn.Conv2d(1, 1, 3)
    monkeypatch.setitem(sys.modules, "plan_bad_models", module)
    with pytest.raises(ConfigError, match=r"factory plan_bad_models:broken raised ZeroDivisionError"):
        model_facts(resolve("plan_bad_models:broken"), 2)
    with pytest.raises(ConfigError, match="returned a str, not an nn.Module"):
        model_facts(resolve("plan_bad_models:not_a_model"), 2)
    with pytest.raises(ConfigError, match="example_inputs"):
        model_facts(resolve("plan_bad_models:conv"), 2)
    with pytest.raises(ConfigError, match="has no 'missing'"):
        resolve("plan_bad_models:missing")
    with pytest.raises(ConfigError, match="cannot import no_such_package"):
        resolve("no_such_package.models:build")
    with pytest.raises(ConfigError, match="llama-2-7b"):
        resolve("llama-9")
    (tmp_path / "c.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ConfigError, match="no model_type"):
        resolve(str(tmp_path / "c.json"))


class _Head(nn.Linear):
    """Logits over a vocabulary of V from C features, as an LM's head."""

    def example_inputs(self, batch, seq):
        return (torch.zeros(batch, self.in_features),)


def test_the_transient_peak_holds_the_gradients_of_what_backward_still_holds():
    """Cross-entropy saves x (B·C, the head's input) and the log-softmax (B·V); in backward the
    gradient of the log-softmax (B·V) and then of the logits (B·V) are made while the log-softmax
    is still held: the peak is at least the saved bytes and one B·V gradient more, and less than
    the saved bytes and three B·V more (no temporary of the vocabulary's size is counted twice)."""
    V = 1000
    loss = lambda logits: torch.nn.functional.cross_entropy(logits, torch.zeros(B, dtype=torch.long))  # noqa: E731
    step = model_facts(source(lambda: _Head(C, V)), B, loss_fn=loss, activation_checkpointing=None).step
    logits = 4 * B * V
    assert 0 <= step.activation_bytes - (4 * B * C + logits) <= 8 * B + 8  # and the targets, a total weight
    assert step.activation_bytes + logits <= step.transient_bytes < step.activation_bytes + 3 * logits
    assert step.activation_peak_bytes == step.transient_bytes
    # the loss holds targets of B rows: the run at 2·B fails, so no dimension is said to follow the batch
    assert step.matmuls and not any(any(shape.scales) for shape, _ in step.matmuls)
