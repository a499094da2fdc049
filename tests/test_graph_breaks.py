"""Zero graph breaks for every block type, and a fullgraph compile of a block matching eager."""

import importlib.util
from pathlib import Path

import pytest
import torch

from titan_kimi.models.kimi_k3 import build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.block import KimiK3Block

_spec = importlib.util.spec_from_file_location("check_graph_breaks", Path(__file__).parents[1] / "scripts/check/graph_breaks.py")
check_graph_breaks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_graph_breaks)


@pytest.mark.parametrize("flavor, kinds", [
    ("k31_debug", {"kda+dense", "kda+moe", "dsa+moe"}),
    ("k3_debug", {"kda+dense", "kda+moe", "mla+moe"}),
])
def test_every_block_type_traces_without_graph_breaks(flavor, kinds):
    results = check_graph_breaks.check(flavor, seq_len=32, device="cpu", dtype=torch.float32)
    assert set(results) == kinds
    assert all(breaks == 0 for breaks in results.values()), results


@pytest.mark.parametrize("layer", [1, 3])  # KDA + MoE, DSA + MoE
def test_fullgraph_compiled_block_matches_eager(layer):
    torch.manual_seed(0)
    args = model_args_for("k31_debug")
    block = KimiK3Block(layer, args)
    block.init_weights()
    hidden = torch.randn(2, 24, args.dim, requires_grad=True)
    bank = torch.randn(48, check_graph_breaks.bank_entries(args, layer), args.dim)
    seq = build_sequence_info(2, 24, hidden.device, torch.tensor([[1] * 24, [1] * 9 + [2] * 15]))
    out, _ = block(hidden, bank, seq)
    grad = torch.autograd.grad(out.sum(), hidden)[0]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out_c, _ = compiled(hidden, bank, seq)
    grad_c = torch.autograd.grad(out_c.sum(), hidden)[0]
    assert torch.allclose(out_c, out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(grad_c, grad, rtol=1e-4, atol=1e-6)
