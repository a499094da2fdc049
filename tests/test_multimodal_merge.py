"""Placeholder expansion (spec §10.4, §16c) against the spec's example and a per-row reference."""

import pytest
import torch

from titan_kimi.models.kimi_k3.multimodal_merge import IGNORE_INDEX, merge_image_features

IMG, PAD = 9, 0


def test_spec_example_expands_one_placeholder_into_two_positions():
    ids = torch.tensor([[1, IMG, 2, PAD]])
    text = torch.randn(1, 4, 5)
    image = torch.randn(2, 5)
    out = merge_image_features(ids, text, image, torch.tensor([2]), IMG, labels=torch.tensor([[1, IMG, 2, -100]]),
                               attention_mask=torch.tensor([[1, 1, 1, 0]]))
    assert out.inputs_embeds.shape == (1, 5, 5)
    assert out.labels.tolist() == [[1, -100, -100, 2, -100]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 0]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 1]]
    assert out.image_mask.tolist() == [[False, True, True, False, False]]
    assert torch.equal(out.inputs_embeds[0, 1:3], image)
    # Token id 0 is not special (§16c): the PAD position keeps its own embedding, it is not zeroed.
    assert torch.equal(out.inputs_embeds[0, [0, 3, 4]], text[0, [0, 2, 3]])


def reference_rows(ids, text, image, counts, labels):
    """Row by row, token by token: a placeholder emits its image's rows, anything else itself."""
    rows, row_labels, it = [], [], 0
    feats = list(torch.split(image, counts))
    for b in range(ids.shape[0]):
        emb, lab = [], []
        for t in range(ids.shape[1]):
            if ids[b, t] == IMG:
                emb.extend(feats[it])
                lab.extend([IGNORE_INDEX] * counts[it])
                it += 1
            else:
                emb.append(text[b, t])
                lab.append(int(labels[b, t]))
        rows.append(torch.stack(emb))
        row_labels.append(lab)
    return rows, row_labels


def test_batch_with_several_images_per_row_matches_reference():
    torch.manual_seed(0)
    ids = torch.tensor([[5, IMG, 6, IMG, 7, 8], [IMG, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]])
    counts = [3, 1, 4]
    text = torch.randn(3, 6, 4)
    image = torch.randn(sum(counts), 4)
    labels = torch.randint(0, 50, (3, 6))
    out = merge_image_features(ids, text, image, torch.tensor(counts), IMG, labels=labels)
    rows, row_labels = reference_rows(ids, text, image, counts, labels)
    S = max(len(r) for r in rows)
    assert out.inputs_embeds.shape == (3, S, 4)
    for b, (row, lab) in enumerate(zip(rows, row_labels)):
        n = len(row)
        assert torch.equal(out.inputs_embeds[b, :n], row)
        assert out.labels[b, :n].tolist() == lab
        assert (out.inputs_embeds[b, n:] == 0).all() and (out.labels[b, n:] == IGNORE_INDEX).all()
        assert out.attention_mask[b].tolist() == [1] * n + [0] * (S - n)
    # Gradients reach both the text embeddings and the image features.
    text.requires_grad_(True)
    image.requires_grad_(True)
    merged = merge_image_features(ids, text, image, torch.tensor(counts), IMG).inputs_embeds
    merged.sum().backward()
    assert (image.grad == 1).all() and text.grad[0, 1].abs().sum() == 0 and (text.grad[0, 0] == 1).all()


def test_fixed_seq_len_drops_trailing_padding_and_rejects_an_image_that_does_not_fit():
    ids = torch.tensor([[1, IMG, 2, PAD, PAD, PAD]])
    text, image = torch.randn(1, 6, 3), torch.randn(3, 3)
    out = merge_image_features(ids, text, image, torch.tensor([3]), IMG, seq_len=6)
    assert out.inputs_embeds.shape == (1, 6, 3)
    assert torch.equal(out.inputs_embeds[0, 1:4], image) and torch.equal(out.inputs_embeds[0, 5], text[0, 3])
    with pytest.raises(ValueError, match="beyond seq_len = 3"):
        merge_image_features(ids, text, image, torch.tensor([3]), IMG, seq_len=3)


@pytest.mark.parametrize("ids, counts", [
    ([[1, IMG, 2, IMG]], [2]),  # two placeholders, one image
    ([[1, 2, 3, 4]], [2]),  # no placeholder, one image
    ([[1, IMG, 2, 3]], [1, 1]),  # one placeholder, two images
])
def test_image_and_placeholder_count_mismatch_raises(ids, counts):
    ids = torch.tensor(ids)
    with pytest.raises(ValueError, match="each image needs exactly one placeholder"):
        merge_image_features(ids, torch.randn(1, 4, 3), torch.randn(sum(counts), 3), torch.tensor(counts), IMG)


def test_feature_rows_must_match_the_image_token_counts():
    with pytest.raises(ValueError, match=r"need \[3, 3\]"):
        merge_image_features(torch.tensor([[IMG, 1]]), torch.randn(1, 2, 3), torch.randn(4, 3), torch.tensor([3]), IMG)
