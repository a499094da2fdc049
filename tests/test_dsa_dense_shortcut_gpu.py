"""GPU: the DSA dense shortcut against the Triton indexer + sparse MLA kernels on a padded batch."""

import pytest
import torch

from lowerings.ops.registry import configure_backends
from titan_kimi.data import IGNORE_INDEX
from titan_kimi.data.causal_keys import longest_document
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.models.kimi_k3.indexer import Indexer
from titan_kimi.training.loss import LinearCrossEntropyLoss

pytestmark = pytest.mark.gpu
TOPK = 64


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.fixture
def backends():
    configure_backends({"kda": "fla", "indexer_topk": "triton", "sparse_mla": "triton"})
    yield
    configure_backends({"kda": "reference", "indexer_topk": "reference", "sparse_mla": "reference"})


def test_shortcut_matches_the_sparse_kernels_on_cuda(backends):
    args = model_args_for("k31_debug", index_topk=TOPK)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(args)
    model.init_weights()
    B, S = 2, 256
    doc = torch.zeros(B, S, dtype=torch.int32)
    doc[0, :60], doc[0, 60:124], doc[1, :50] = 1, 2, 1  # documents <= TOPK, padding runs of 132 and 206
    keys = longest_document(doc)  # on the host, as the trainer reads it
    doc = doc.cuda()
    tokens = torch.randint(1, args.vocab_size, (B, S), device="cuda")
    labels = torch.where(doc > 0, torch.randint(0, args.vocab_size, (B, S), device="cuda"), IGNORE_INDEX)
    normalizer = float((labels != IGNORE_INDEX).sum())
    with torch.device("cuda"):  # the same weights, without the shortcut
        sparse_model = KimiK3Model(args.replace(dsa_dense_shortcut=False))
    sparse_model.load_state_dict(model.state_dict())
    models = {True: model, False: sparse_model}
    calls = []
    for m in (*model.modules(), *sparse_model.modules()):
        if isinstance(m, Indexer):
            m.register_forward_hook(lambda *_: calls.append(1))

    def run(shortcut: bool):
        model = models[shortcut]
        model.zero_grad(set_to_none=True)
        hidden = model(tokens, doc_ids=doc, return_hidden=True, max_causal_keys=keys)
        loss = LinearCrossEntropyLoss(128)(model.output, hidden, labels, normalizer)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    dense_loss, dense_grads = run(True)
    assert not calls
    sparse_loss, sparse_grads = run(False)
    assert calls
    assert rel_err(dense_loss, sparse_loss) < 1e-4
    worst = max(rel_err(dense_grads[n], g) for n, g in sparse_grads.items())
    assert worst < 1e-2, worst
