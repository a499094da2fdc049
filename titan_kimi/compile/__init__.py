"""torch.compile for the trainer: its on-disk caches, prewarm processes, its report (applying it to a built model is
one of the parallelize steps: ``titan_kimi.parallel.compile``)."""
