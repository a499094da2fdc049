"""Building a run from its config: model args, tokenizer, model, data, kernel backends, seeded weights."""
