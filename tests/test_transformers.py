"""transformers models and dict batches through `train_step(batch)`: the model computes its own
loss (loss_fn left out), `weight="tokens"` counts the labels that are not -100, and each run
equals one process on the whole batch."""

import pytest
import torch

import paratrain as pt
from paratrain.testing import max_param_diff, run_on_ranks

pytest.importorskip("transformers")

STEPS, BATCH, LENGTH, VOCAB = 3, 8, 8, 11


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def batches(padded: bool):
    """Dict batches as a tokenizer gives them; with `padded`, each sequence's tail is ignored
    (labels -100) from a random point on, so ranks hold different numbers of tokens."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        labels = ids.clone()
        if padded:
            ends = torch.randint(2, LENGTH + 1, (BATCH,), generator=g)
            labels[torch.arange(LENGTH) >= ends[:, None]] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference(padded):
    model = gpt2()
    opt = _sgd(model)
    for batch in batches(padded):
        model(**batch).loss.backward()  # the mean over every unignored (shifted) label of the batch
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(topo, strategy, padded):
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = gpt2()
    model, _ = session.setup(model, _sgd(model))
    for batch in batches(padded):
        mine = {k: v.chunk(model.replicas)[model.replica_index] for k, v in batch.items()}
        session.train_step(mine, weight="tokens" if padded else None)  # no loss_fn: the model's own
    return session.full_state_dict()


@pytest.mark.parametrize("strategy,padded", [("ddp", False), ("zero3", False), ("ddp", True), ("zero2", True)])
def test_gpt2_trains_through_train_step_with_dict_batches(strategy, padded):
    expected = _reference(padded)
    for state in run_on_ranks(_train, 2, strategy, padded, timeout=300):
        assert max_param_diff({k: state[k] for k in expected}, expected) < 1e-6  # measured: up to 6e-8


def test_a_pipeline_takes_the_dict_batch_and_the_built_in_loss():
    expected = _reference(False)
    for state in run_on_ranks(_train, 2, pt.Pipeline(stages=2, microbatches=2), False, timeout=300):
        assert max_param_diff({k: state[k] for k in expected}, expected) < 1e-6


def test_a_dict_batch_without_labels_or_loss_fn_says_what_to_pass():
    with pt.Session("single", progress_bar=False) as session:
        model = gpt2()
        model, _ = session.setup(model, _sgd(model))
        with pytest.raises(pt.UsageError, match="put labels in the batch"):
            session.train_step({"input_ids": batches(False)[0]["input_ids"]})
        with pytest.raises(pt.UsageError, match="needs loss_fn"):
            session.train_step((batches(False)[0]["input_ids"], batches(False)[0]["labels"]))


def tagger():
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=LENGTH, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForTokenClassification(config)


def test_weight_tokens_counts_a_token_classifiers_labels_unshifted():
    """A token classifier's labels have input_ids' shape but line up with them (no shift, unlike a
    causal LM's): weight="tokens" must count them all, so two micro-batches holding 5 and 12 label
    tokens train as one process on the whole batch (it counted labels[..., 1:] before)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, LENGTH), generator=g)
    labels = torch.randint(0, 3, (4, LENGTH), generator=g)
    labels[0, 2:] = -100
    labels[1, 3:] = -100
    reference = tagger()
    reference(input_ids=ids, labels=labels).loss.backward()
    with pt.Session("single", accumulate=2, progress_bar=False) as session:
        model = tagger()
        _, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = {}
        opt.register_step_pre_hook(lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters()}))
        for rows in (slice(0, 2), slice(2, 4)):
            session.train_step({"input_ids": ids[rows], "labels": labels[rows]}, weight="tokens")
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert max_param_diff({n: seen[n] for n in expected}, expected) < 1e-6
