"""Indexer training under FSDP2, EP, PP and CP (with selective activation checkpointing, and with the attention
modules compiled) on 4 gloo ranks: one step's gradients (the indexer's from the KL, the rest from the LM loss)
and the KL metric against one process on the whole global batch, in fp32 (tests/parallel_parity_worker.py, one
launch with the layouts of test_parallel.py and test_context_parallel.py: tests/parity_runs.py). Most of its
time is Inductor compiling the modules of the last layout."""

import re

import pytest

NAMES = ["sparse_pp2_ep2_fsdp2", "sparse_cp2_dp2_sac", "warmup_cp2_pp2", "sparse_ep2_module_compile"]


@pytest.mark.slow
def test_indexer_training_under_every_parallelism_gives_one_process_gradients_and_kl(parity_runs):
    out = parity_runs.output()
    results = parity_runs.parity(NAMES)
    kls = dict(re.findall(r"INDEXER (\S+) kl_rel (\S+)", out))  # of every layout launched: these alone train it
    assert set(results) == set(kls) == set(NAMES), out
    for name, (grad, loss, params) in results.items():
        assert float(grad) < 1e-4 and float(loss) < 1e-5 and int(params) >= 10, (name, grad, loss, params)
        assert float(kls[name]) < 1e-4, (name, kls[name])  # KLs of ~2e-4 summed in another order
