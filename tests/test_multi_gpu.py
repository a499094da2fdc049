"""Two GPUs over NCCL: the CPU parity workers launched under torchrun on 2 ranks, one GPU each.

- NCCL EP all-to-all: the Trainer's step at EP2 (the MoE layers' token all-to-all, forward and backward) against
  one GPU on the whole global batch (tests/parallel_parity_worker.py ``ep2``);
- PP hand-off: PP2 1F1B and ZBVZeroBubble steps (activations and gradients sent between the GPUs) against one GPU
  (``pp2_1f1b``, ``pp2_zbv``);
- CP: the KDA (FLA's cp_context), dense MLA and DSA (latent gather, Triton indexer and sparse MLA) layers at CP2,
  zigzag and contiguous, against one GPU on the whole rows (tests/cp_layer_worker.py --device cuda).

All in fp32. The bounds are the CPU tests' loosened for the GPU and not yet measured on one (the GPU reductions
and FLA's Triton dots round differently from the CPU's); the workers print what they measure.
"""

import re

import pytest
import torch

from tests.test_parallel import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 CUDA devices (NCCL between them), found {torch.cuda.device_count()}"),
]
GRAD_REL, LOSS_REL = 1e-3, 1e-4  # CPU: 1e-4 / 1e-5 (tests/test_parallel.py)
CP_OUT_REL, CP_GRAD_REL = 1e-2, 2e-2  # tests/test_context_parallel_gpu.py's cp_context vs one-rank bounds


@pytest.fixture(scope="module")
def parity() -> dict[str, tuple[float, float, int]]:
    out = launch(["tests/parallel_parity_worker.py", "ep2", "pp2_1f1b", "pp2_zbv"], nproc=2)
    print(out)
    return {name: (float(grad), float(loss), int(params)) for name, grad, loss, params in
            re.findall(r"PARITY (\S+) grad_rel (\S+) loss_rel (\S+) params (\d+)", out)}


def test_nccl_expert_all_to_all_matches_one_gpu(parity):
    grad, loss, params = parity["ep2"]
    assert grad < GRAD_REL and loss < LOSS_REL and params > 100, parity["ep2"]


@pytest.mark.parametrize("name", ["pp2_1f1b", "pp2_zbv"])
def test_pipeline_hand_off_matches_one_gpu(parity, name):
    grad, loss, params = parity[name]
    assert grad < GRAD_REL and loss < LOSS_REL and params > 100, parity[name]


def test_cp_kda_mla_dsa_layers_match_one_gpu():
    out = launch(["tests/cp_layer_worker.py", "--device", "cuda"], nproc=2)
    print(out)
    rows = re.findall(r"CP (\w+) (\w+) world (\d) out (\S+) dx (\S+) grads (\S+) remote (\S+)", out)
    assert {(kind, layout, world) for kind, layout, world, *_ in rows} == {
        (kind, layout, "2") for kind in ("kda", "mla", "dsa") for layout in ("contiguous", "zigzag")}, out
    for kind, layout, _, o, dx, grads, remote in rows:
        assert max(float(o), float(dx)) < CP_OUT_REL and float(grads) < CP_GRAD_REL, (kind, layout, o, dx, grads)
        if kind == "dsa":
            assert float(remote) > 0.2, (layout, remote)  # keys chosen on the other GPU take part
