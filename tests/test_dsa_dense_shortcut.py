"""The DSA dense shortcut: with every document within index_topk, dense attention gives the same loss and
gradients as the indexer + sparse attention; it is taken only then, decided on the host, without graph breaks."""

import pytest
import torch

from titan_kimi.data import IGNORE_INDEX
from titan_kimi.data.causal_keys import longest_document
from titan_kimi.models.kimi_k3 import build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.block import KimiK3Block
from titan_kimi.models.kimi_k3.indexer import Indexer
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.training.loss import LinearCrossEntropyLoss

TOPK = 16


def test_longest_document_counts_runs_of_documents_not_padding():
    doc = torch.tensor([[1] * 5 + [2] * 3 + [0] * 12, [1] * 7 + [0] * 13])
    assert longest_document(doc) == 7  # the padding runs (12, 13) do not count
    assert longest_document(torch.tensor([[1, 1, 1], [1, 1, 1]])) == 3  # runs never continue into the next row
    assert longest_document(torch.zeros(2, 4, dtype=torch.int32)) == 0
    with pytest.raises(ValueError, match=r"shape \(4,\); expected \[batch, seq_len\]"):
        longest_document(torch.ones(4, dtype=torch.int32))


def tiny_model(dsa_dense_shortcut: bool = True) -> KimiK3Model:
    """The same weights whatever ``dsa_dense_shortcut`` (a setting of the args, drawn nothing from)."""
    torch.manual_seed(0)
    model = KimiK3Model(model_args_for("k31_debug", index_topk=TOPK, dsa_dense_shortcut=dsa_dense_shortcut))
    model.init_weights()
    return model


def padded_batch(lengths: list[list[int]], seq_len: int):
    """Rows of documents then padding (doc id 0, label -100), as nonpacked MedPix pads each sample."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 2048, (len(lengths), seq_len), generator=g)
    doc = torch.zeros(len(lengths), seq_len, dtype=torch.int32)
    for row, docs in enumerate(lengths):
        start = 0
        for i, n in enumerate(docs):
            doc[row, start:start + n] = i + 1
            start += n
    labels = torch.where(doc > 0, torch.randint(0, 2048, tokens.shape, generator=g), IGNORE_INDEX)
    return tokens, doc, labels


def loss_and_grads(model, tokens, doc, labels, max_causal_keys, context_parallel=None):
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules() if isinstance(m, Indexer)]
    model.zero_grad(set_to_none=True)
    hidden = model(tokens, doc_ids=doc, return_hidden=True, max_causal_keys=max_causal_keys,
                   context_parallel=context_parallel)
    loss = LinearCrossEntropyLoss(64)(model.output, hidden, labels, float((labels != IGNORE_INDEX).sum()))
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(calls)


def test_shortcut_gives_the_sparse_loss_and_gradients_when_every_document_fits():
    model = tiny_model()
    # Documents of at most TOPK tokens; padding runs of 21 and 26 tokens, longer than TOPK, are not trained.
    tokens, doc, labels = padded_batch([[12, 7], [14]], seq_len=40)
    keys = longest_document(doc)
    assert keys == 14 <= TOPK
    dense_loss, dense_grads, dense_calls = loss_and_grads(model, tokens, doc, labels, keys)
    model = tiny_model(dsa_dense_shortcut=False)
    sparse_loss, sparse_grads, sparse_calls = loss_and_grads(model, tokens, doc, labels, keys)
    n_dsa = sum(isinstance(m, Indexer) for m in model.modules())
    assert n_dsa > 0 and dense_calls == 0 and sparse_calls == n_dsa
    torch.testing.assert_close(dense_loss, sparse_loss, rtol=1e-5, atol=1e-5)
    assert dense_grads.keys() == sparse_grads.keys() and dense_grads
    for name in dense_grads:
        torch.testing.assert_close(dense_grads[name], sparse_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("lengths, seq_len, max_keys, dense", [
    ([[TOPK + 1], [3]], 24, TOPK + 1, False),  # one document longer than index_topk
    ([[TOPK], [3]], 24, TOPK, True),
    ([[24], [24]], 24, None, False),  # unknown: the whole row, longer than index_topk
    ([[TOPK], [TOPK]], TOPK, None, True),  # unknown, but no row is longer than index_topk
])
def test_shortcut_taken_only_when_no_trained_query_has_more_keys_than_topk(lengths, seq_len, max_keys, dense):
    model = tiny_model()
    tokens, doc, labels = padded_batch(lengths, seq_len)
    _, _, calls = loss_and_grads(model, tokens, doc, labels, max_keys)
    assert (calls == 0) == dense
    seq = build_sequence_info(2, seq_len, torch.device("cpu"), doc)
    assert model.dsa_dense(seq, max_keys) == dense


def test_bad_max_causal_keys_is_rejected():
    model = tiny_model()
    seq = build_sequence_info(1, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"max_causal_keys = -1: expected a Python int >= 0, or None"):
        model.dsa_dense(seq, -1)


def test_compiled_dsa_block_takes_both_paths_without_graph_breaks_or_more_compiles():
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    args = model_args_for("k31_debug", index_topk=TOPK)
    layer = 3  # DSA + MoE (tests/test_graph_breaks.py)
    block = KimiK3Block(layer, args)
    assert block.attention.indexer is not None
    block.init_weights()
    hidden = torch.randn(2, 12, args.dim)
    from tests.test_graph_breaks import check_graph_breaks

    bank = torch.randn(24, check_graph_breaks.bank_entries(args, layer), args.dim)
    doc = torch.tensor([[1] * 12, [1] * 5 + [2] * 7])
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    outs = {}
    for dense in (True, False, True, False):  # the batch-to-batch alternation of a training run
        seq = build_sequence_info(2, 12, hidden.device, doc)
        seq.dsa_dense = dense
        outs[dense] = compiled(hidden, bank, seq)[0]
    assert counter.frame_count == 2  # one graph per value of the bool, no recompile after
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)


def test_shortcut_under_context_parallelism_decides_from_the_whole_rows(one_rank_group):
    """One rank's zigzag pieces: the whole row (48 tokens) is longer than index_topk, so only the batch's
    documents (all within it) allow the shortcut, which then gives the sparse CP path's outputs and gradients."""
    from titan_kimi.parallel.context_parallel import ContextParallel

    models = {shortcut: tiny_model(dsa_dense_shortcut=shortcut) for shortcut in (True, False)}
    cp = ContextParallel(one_rank_group, "zigzag")
    tokens, doc, labels = padded_batch([[16, 10, 16, 6], [9, 16, 16, 7]], seq_len=48)
    keys = longest_document(doc)
    runs = {}
    for shortcut, max_keys in ((True, keys), (False, keys), (True, None)):
        runs[shortcut, max_keys] = loss_and_grads(models[shortcut], tokens, doc, labels, max_keys, cp)
    assert runs[True, keys][2] == 0 and runs[False, keys][2] > 0
    assert runs[True, None][2] > 0  # without the batch's fact: the whole row's 48 keys, more than TOPK
    dense, sparse = runs[True, keys], runs[False, keys]
    torch.testing.assert_close(dense[0], sparse[0], rtol=1e-5, atol=1e-5)
    for name in sparse[1]:
        torch.testing.assert_close(dense[1][name], sparse[1][name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("value", ["true", "false"])
def test_config_knob_reaches_every_built_model(value):
    from titan_kimi.config import load_job_config
    from titan_kimi.training.setup.build import build_model_from_config, model_args_from_config, tokenizer_from_config

    cfg = load_job_config(["--model.flavor", "k31_debug", "--model.dsa_dense_shortcut", value], environ={})
    args = model_args_from_config(cfg)
    model = build_model_from_config(cfg, args, tokenizer_from_config(cfg, args))
    assert model.args.dsa_dense_shortcut is (value == "true")
    seq = build_sequence_info(1, 8, torch.device("cpu"))
    assert model.dsa_dense(seq, 8) is (value == "true")  # 8 keys <= index_topk 32
