"""What "mixers" checkpointing keeps per layer: the step-time estimate's byte counts against what the GPU
backends' token-mixer ops return (their fake implementations, at K3's widths), and the table rule that an entry
measured while keeping outputs times only jobs that keep the same."""

import json
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lowerings.ops.registry import plan_as_cuda, resolved_backends
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.parallel.step_time.kept_outputs import kept_bytes
from titan_kimi.parallel.step_time.table import Table, merge_entries

T = 256


def nbytes(tree) -> int:
    flat = tree if isinstance(tree, (list, tuple)) else [tree]
    return sum(nbytes(x) if isinstance(x, (list, tuple)) else x.numel() * x.element_size() for x in flat)


def test_kept_bytes_are_what_the_gpu_token_mixers_return():
    a = model_args_for("k31")
    ops = torch.ops.titan_kimi
    H, K = a.kda_num_heads, a.kda_head_dim
    latent = a.kv_lora_rank + a.qk_rope_head_dim
    backends = resolved_backends().replaced({"kda": "fla", "sparse_mla": "triton", "indexer_topk": "triton"})
    with FakeTensorMode(), plan_as_cuda(backends):
        q = torch.empty(1, T, H, K, dtype=torch.bfloat16)
        kda = ops.kda.default(q, q, q, q, torch.empty(1, T, H), torch.empty(H), torch.empty(H * K), -5.0,
                              K ** -0.5, None, None, False, True)
        mla = ops.sparse_mla.default(torch.empty(T, a.n_heads, latent, dtype=torch.bfloat16),
                                     torch.empty(T, latent, dtype=torch.bfloat16),
                                     torch.empty(T, a.index_topk, dtype=torch.int32), 0.1, a.kv_lora_rank)
        topk = ops.indexer_topk.default(torch.empty(T, a.index_n_heads, a.index_head_dim, dtype=torch.bfloat16),
                                        torch.empty(T, a.index_head_dim, dtype=torch.bfloat16),
                                        torch.empty(T, a.index_n_heads), torch.zeros(T, dtype=torch.long),
                                        a.index_topk, 0.1)
        # under CP (one row, zigzag: two sequence parts per rank): the incoming state of each part besides
        kda_cp = ops.kda_cp.default(q, q, q, q, torch.empty(1, T, H), torch.empty(H), torch.empty(H * K), -5.0,
                                    K ** -0.5, torch.tensor([0, T], dtype=torch.int32), "group", "zigzag")
    # a KDA layer: the output and FLA's residuals (no final state); a DSA layer: sparse MLA's and the top-k
    assert kept_bytes(a, "kda+moe", T) == nbytes(kda) == T * H * (K * 2 + 2 * 4 + 2 * 64 * 2)
    assert kept_bytes(a, "kda+moe", T, state_parts=2) == nbytes(kda_cp) == nbytes(kda) + 2 * H * K * K * 4
    assert kept_bytes(a, "dsa+moe", T) == nbytes(mla) + nbytes(topk)
    # dense attention: the output [T, H, v] in bf16 and the log-sum-exp in fp32 (FlashAttention's contract)
    assert kept_bytes(a, "mla+dense, block start", T) == T * a.n_heads * (a.v_head_dim * 2 + 4)
    with pytest.raises(ValueError, match="'vision'"):
        kept_bytes(a, "vision", T)


def test_kept_bytes_at_k31_width_fit_the_recipe_stage_as_documented():
    """The sizes docs/parallelism.md quotes per 4,096 tokens: ~200 MB per KDA layer, ~440 MB per DSA layer."""
    a = model_args_for("k31")
    assert math.isclose(kept_bytes(a, "kda+moe", 4096) / 1e6, 204, rel_tol=0.01)
    assert math.isclose(kept_bytes(a, "dsa+moe", 4096) / 1e6, 438, rel_tol=0.01)


def test_an_entry_that_kept_outputs_times_only_jobs_that_keep_the_same(tmp_path):
    def entry(fwd_ms, bwd_ms, checkpointing):
        return {"tokens": 4096, "rows": "r", "ac": 1.0, "load": "balanced", "forward_ms": fwd_ms,
                "backward_ms": bwd_ms, "forward_flops": 4e12, "backward_flops": 8e12,
                "checkpointing": checkpointing}

    data = merge_entries(None, "g", "layers", "kda+moe", entry(4.0, 12.0, "full"), hardware="NVIDIA H200",
                         peak_flops=989e12)
    data = merge_entries(data, "g", "layers", "kda+moe", entry(4.0, 11.0, "selective/mixers"),
                         hardware="NVIDIA H200", peak_flops=989e12)
    # an entry without the key ran under full checkpointing: a new full entry replaces it
    legacy = dict(entry(4.0, 13.0, "full"))
    del legacy["checkpointing"]
    data["geometries"]["g"]["layers"]["kda+moe"].insert(0, legacy)
    data = merge_entries(data, "g", "layers", "kda+moe", entry(4.0, 12.0, "full"), hardware="NVIDIA H200",
                         peak_flops=989e12)
    assert [e["backward_ms"] for e in data["geometries"]["g"]["layers"]["kda+moe"]] == [11.0, 12.0]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    table = Table.load(path)

    def bwd(checkpointing):
        return table.time_ms("g", "layers", "kda+moe", 4096, 4e12, 8e12, 1.0,
                             settings={"checkpointing": checkpointing})[1]

    assert bwd("selective/mixers") == pytest.approx(11.0)  # its own measurement
    assert bwd("full") == pytest.approx(12.0)  # never the one that recomputed less
    full_only = Table({**data, "geometries": {"g": {"layers": {"kda+moe": [entry(4.0, 12.0, "full")]}}}}, path)
    # a mixers job without its own entries: full's, which count the whole forward again (an upper bound)
    assert full_only.time_ms("g", "layers", "kda+moe", 4096, 4e12, 8e12, 1.0,
                             settings={"checkpointing": "selective/mixers"})[1] == pytest.approx(12.0)
