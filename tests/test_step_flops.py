"""The FLOPs a step counts: padding tokens skip the routed experts, so their share of a token's FLOPs is left out
of the trainer's MFU."""

import torch

from titan_kimi.models.kimi_k3 import KimiK3Model, count_params, model_args_for


def test_routed_expert_flops_are_the_experts_share_of_a_token():
    """What a padding token (which skips the routed experts) does not cost: 6 FLOPs per routed-expert weight a
    token touches (top_k of num_experts), 2 or 4 for frozen ones, nothing else."""
    from titan_kimi.models.kimi_k3.accounting import routed_expert_flops_per_token

    args = model_args_for("k3_debug")
    with torch.device("meta"):
        model = KimiK3Model(args)
    counts = count_params(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    assert counts.routed == experts * args.num_experts_per_tok // args.num_experts
    assert routed_expert_flops_per_token(counts) == 6 * counts.routed
    for n, p in model.named_parameters():
        if ".moe.experts." in n:
            p.requires_grad_(False)
    frozen = count_params(model)
    assert frozen.routed_frozen == frozen.routed == counts.routed
    assert routed_expert_flops_per_token(frozen) == 2 * counts.routed
    assert routed_expert_flops_per_token(frozen, frozen_backward=True) == 4 * counts.routed


def _fake_trainer(pp: int, cp: int):
    from types import SimpleNamespace

    from titan_kimi.trainer import Trainer

    fake = SimpleNamespace(layout=SimpleNamespace(pp=pp, cp=cp), _image_work=lambda h: (0, 0.0),
                           routed_flops_per_token=10.0)
    fake.flops_per_token = lambda seq_len: 100.0 + seq_len  # the attention terms grow with the batch's length
    return fake, lambda host: Trainer._step_totals(fake, host)


def test_a_step_counts_its_padding_tokens_once_per_pipeline_and_context_parallel_group():
    """The trainer's MFU leaves the padding tokens' routed-expert FLOPs out: its step totals count padding on the
    whole rows' doc ids (which every CP rank holds), once per step."""
    doc = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 2, 2, 2, 2, 2, 0, 0]])
    labels = torch.where(doc > 0, torch.ones_like(doc), torch.full_like(doc, -100))
    host = [{"doc_ids": doc, "labels": labels}, {"doc_ids": doc, "labels": labels}]
    for pp, cp in ((1, 1), (2, 1), (1, 2)):
        _, totals = _fake_trainer(pp, cp)
        valid, images, flops, tokens = totals(host)
        assert valid == 2 * 9 / pp and images == 0
        assert tokens == 2 * 16 / (pp * cp)
        # 32 tokens at 108 FLOPs, less 14 padding tokens' routed share, each CP rank's share, once per pipeline
        assert flops == (2 * 16 * 108.0 - 2 * 7 * 10.0) / (pp * cp)


def test_a_trimmed_step_counts_each_micro_batch_at_its_own_length():
    """Micro-batches cut to different lengths (``training.pad_to_multiple_of``): each counts its own tokens at its
    own length's FLOPs per token."""
    from titan_kimi.data.trim import trim_padding

    doc = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]])
    labels = torch.where(doc > 0, torch.ones_like(doc), torch.full_like(doc, -100))
    host = [trim_padding({"doc_ids": doc, "labels": labels}, 2),
            trim_padding({"doc_ids": doc[1:], "labels": labels[1:]}, 1)]
    assert [tuple(b["doc_ids"].shape) for b in host] == [(2, 4), (1, 2)]
    _, totals = _fake_trainer(1, 1)
    valid, _, flops, tokens = totals(host)
    assert valid == 5 + 2 and tokens == 8 + 2
    assert flops == 8 * 104.0 + 2 * 102.0 - (3 + 0) * 10.0
