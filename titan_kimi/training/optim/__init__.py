"""The optimizer step: Adam(W) with its own moment dtype, the learning-rate schedule, gradient clipping."""
