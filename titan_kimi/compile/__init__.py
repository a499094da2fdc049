"""torch.compile for the trainer: applying it to a built model, its on-disk caches, prewarm processes, its report."""
