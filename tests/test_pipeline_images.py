"""Images regrouped per sample for pipeline microbatches: padding, splitting along the batch, packing again."""

import pytest
import torch

from titan_kimi.parallel.pipeline_images import ImageSlots, unpad_images

IMG = 7


def packed_batch():
    """Three rows: two images, none, one; grids of 4, 6 and 2 patches, pixels numbered by patch."""
    input_ids = torch.tensor([[1, IMG, 2, IMG], [1, 2, 3, 4], [IMG, 5, 6, 0]])
    grid_thws = torch.tensor([[1, 2, 2], [1, 2, 3], [1, 1, 2]])
    pixel_values = torch.arange(12, dtype=torch.float32).view(12, 1, 1, 1).expand(12, 3, 2, 2).contiguous()
    return input_ids, pixel_values, grid_thws


def test_padding_per_sample_splits_into_microbatches_that_pack_back_to_their_own_images():
    input_ids, pixel_values, grid_thws = packed_batch()
    slots = ImageSlots(IMG, max_images=2, max_patches=11)
    pixels, grids = slots.pad(input_ids, pixel_values, grid_thws)
    assert pixels.shape == (3, 11, 3, 2, 2) and grids.shape == (3, 2, 3)
    assert grids.tolist() == [[[1, 2, 2], [1, 2, 3]], [[0, 0, 0], [0, 0, 0]], [[1, 1, 2], [0, 0, 0]]]
    whole = unpad_images(pixels, grids)
    assert torch.equal(whole[0], pixel_values) and torch.equal(whole[1], grid_thws)
    # Microbatches of one sample each (as the schedule splits dim 0): each gets exactly its own patches.
    starts = [0, 10, 10]
    for row, (n_patches, n_images) in enumerate([(10, 2), (0, 0), (2, 1)]):
        pv, g = unpad_images(pixels[row:row + 1], grids[row:row + 1])
        assert g.shape == (n_images, 3)
        assert torch.equal(pv, pixel_values[starts[row]:starts[row] + n_patches])


def test_samples_beyond_the_slots_and_inconsistent_batches_are_rejected():
    input_ids, pixel_values, grid_thws = packed_batch()
    with pytest.raises(ValueError, match="a sample has 10 image patches, more than the run's 9 patch slots"):
        ImageSlots(IMG, 2, 9).pad(input_ids, pixel_values, grid_thws)
    with pytest.raises(ValueError, match="a sample holds 2 images, more than the run's 1 image slot"):
        ImageSlots(IMG, 1, 16).pad(input_ids, pixel_values, grid_thws)
    with pytest.raises(ValueError, match="3 image placeholder.*but the batch has 2 image"):
        ImageSlots(IMG, 2, 16).pad(input_ids, pixel_values, grid_thws[:2])


def test_slots_are_the_largest_sample_of_the_run_s_datasets():
    class Data:
        def __init__(self, bounds):
            self.bounds = bounds

        def image_bounds(self):
            return self.bounds

    slots = ImageSlots.for_datasets(IMG, [Data((1, 64)), Data((2, 16))])
    assert (slots.max_images, slots.max_patches) == (2, 64)
