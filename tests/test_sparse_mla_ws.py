"""The warp-specialized Gluon sparse-MLA forward (lowerings/kernels/sparse_mla_fwd_ws.py).

CPU: it compiles for sm_90a (ahead of time, no GPU) with either 16-bit dtype and fits in shared memory.
GPU (sm90 only): against the fp32 gather reference on fresh random inputs, including the slots the kernel must
ignore (-1 anywhere in a row, ids >= S_kv), rows with no valid key, top-k not a multiple of the 64-key step,
head counts that leave a partial 64-head block, strided q, and fp16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_triton_kernels import assert_lse_close, rel_err

ROOT = Path(__file__).resolve().parents[1]


def _gluon_available() -> bool:
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _gluon_available(), reason="this Triton has no Gluon")
def test_ws_forward_compiles_for_sm90(tmp_path):
    # a subprocess: the CPU tests run under TRITON_INTERPRET=1, which turns kernels into interpreted functions
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check" / "sm90_kernel_resources.py"), "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = [json.loads(line) for line in run.stdout.splitlines()]
    assert [s["dtype"] for s in stats] == ["bf16", "fp16"]
    from lowerings.kernels.sparse_mla_fwd_ws import WS_CONFIG

    regs = str(WS_CONFIG["CONSUMER_REGS"])
    for s in stats:
        assert 0 < s["shared"] <= s["max_shared"], s
        assert s["wgmma"] > 0 and s["cp_async"] > 0 and regs in s["setmaxnreg"], s  # the WS structure survived
        # 292 B today: one consumer's loop-invariant wgmma descriptors and the producer's row pointers (measured at
        # 334-349 TFLOP/s with them); spilling the accumulators would cost kilobytes
        assert s["spill_stores"] <= 512, s


def test_ws_forward_declines_what_it_cannot_run():
    from lowerings.kernels.sparse_mla_fwd import ws_forward_reason

    q = torch.zeros(4, 2, 576, dtype=torch.bfloat16)
    assert ws_forward_reason(q, torch.zeros(4, 576, dtype=torch.bfloat16), 512) == "not on a CUDA device"


sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm90 GPU",
)


@pytest.mark.gpu
@sm90  # the alignment check is reached on sm90 only
def test_gpu_ws_forward_declines_unaligned_rows():
    from lowerings.kernels.sparse_mla_fwd_ws import ws_forward_unsupported

    q = torch.zeros(4, 2, 580, dtype=torch.bfloat16, device="cuda")[:, :, :576]  # head stride 580: 8-byte rows
    kv = torch.zeros(4, 576, dtype=torch.bfloat16, device="cuda")
    assert "16-byte" in ws_forward_unsupported(q, kv, 512)
    assert ws_forward_unsupported(q.contiguous(), kv, 512) is None


def _reference(q, kv, idx, scale):
    from lowerings.ops.sparse_mla import sparse_mla_reference

    return sparse_mla_reference(q.float(), kv.float(), idx, scale, 512)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("H,k,dtype,peak", [(96, 2048, torch.bfloat16, 1.0), (96, 200, torch.bfloat16, 1.0),
                                            (16, 320, torch.bfloat16, 1.0), (128, 256, torch.float16, 1.0),
                                            (64, 1000, torch.bfloat16, 30.0)])
def test_gpu_ws_forward_matches_reference(H, k, dtype, peak):
    # peak = 30: scores spread over ~100 (log2 units), so one warpgroup's key blocks often sit far below the other's
    # running max (the factor f = 2^(r - m) underflows and is clamped at 2^-64)
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward, ws_forward_reason

    T, S, scale = 700, 650, 192 ** -0.5
    gen = torch.Generator().manual_seed(H + k)
    q_wide = (peak * torch.randn(T, H, 640, generator=gen)).to("cuda", dtype)
    q = q_wide[:, :, :576]  # strided heads: stride(1) = 640
    kv = torch.randn(S, 576, generator=gen).to("cuda", dtype)
    idx = torch.randint(0, S + 40, (T, k), generator=gen, dtype=torch.int32)  # ids >= S must be ignored
    idx[torch.rand(T, k, generator=gen) < 0.3] = -1  # holes anywhere, not only a suffix
    idx[5] = -1  # a row with no valid key: out 0, lse -inf
    idx[6, 1:] = -1
    idx = idx.cuda()
    assert ws_forward_reason(q, kv, 512) is None
    out, lse = sparse_mla_forward(q, kv, idx, scale, 512)
    ro, rl = _reference(q, kv, torch.where(idx < S, idx, -1), scale)
    assert rel_err(out, ro) <= 1e-2
    assert_lse_close(lse, rl, 1e-2)
    assert torch.equal(out[5], torch.zeros_like(out[5])) and torch.isneginf(lse[5]).all()
