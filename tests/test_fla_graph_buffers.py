"""FLA's graph-mode buffers become fresh tensors per call (lowerings/kernels/fla_graph_buffers.py): on CPU, the
FLA modules that bind ``get_static_buffer`` are repointed, two calls with one key give two tensors, ``zero``
zeroes, and a module that lost the name is refused by name."""

import sys
import types

import pytest
import torch

from lowerings.kernels import fla_graph_buffers
from lowerings.kernels.fla_graph_buffers import fresh_buffer, use_fresh_graph_buffers


def test_every_binding_module_takes_fresh_buffers():
    use_fresh_graph_buffers()
    assert use_fresh_graph_buffers() == []  # idempotent: nothing left to patch
    import fla.ops.common.chunk_delta_h as delta_h
    import fla.ops.kda.chunk_bwd as chunk_bwd
    import fla.ops.kda.chunk_intra as chunk_intra

    for module in (chunk_bwd, chunk_intra, delta_h):
        assert module.get_static_buffer is fresh_buffer
    a = chunk_bwd.get_static_buffer("wy_dv2", (2, 3), torch.bfloat16, "cpu")
    b = chunk_bwd.get_static_buffer("wy_dv2", (2, 3), torch.bfloat16, "cpu")
    assert a.data_ptr() != b.data_ptr() and a.shape == (2, 3) and a.dtype == torch.bfloat16
    b.fill_(3.0)
    z = chunk_bwd.get_static_buffer("wy_dv2", (2, 3), torch.float32, "cpu", zero=True)
    assert torch.count_nonzero(z) == 0


def test_a_module_without_the_name_is_named(monkeypatch):
    monkeypatch.setattr(fla_graph_buffers, "_MODULES", ("fla_moved_it",))
    monkeypatch.setitem(sys.modules, "fla_moved_it", types.ModuleType("fla_moved_it"))
    with pytest.raises(ValueError, match=r"fla_moved_it has no get_static_buffer .*FLA 0.6.0"):
        use_fresh_graph_buffers()
