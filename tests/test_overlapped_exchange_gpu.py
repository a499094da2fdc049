"""The all-to-all with work alongside on CUDA over NCCL (one rank): the exchange's rows and gradients, which
reach the autograd engine unwaited from the communicator's stream, equal the plain exchange's; and the
hierarchical dispatch's route, one rank standing for both levels, gives the plain MoE's output and gradients
(bf16)."""

import pytest
import torch
import torch.distributed as dist


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def nccl_one_rank(tmp_path):
    """A one-rank NCCL group on GPU 0 (only @pytest.mark.gpu tests use it: conftest skips them without CUDA)."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_exchange_with_work_alongside_equals_the_two_apart(nccl_one_rank):
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from titan_kimi.parallel.overlapped_exchange import all_to_all_alongside

    torch.manual_seed(0)
    rows = 4096
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    cot_y, cot_s = torch.randn_like(x), torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)

    def run(overlapped: bool) -> list[torch.Tensor]:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        work = lambda: torch.nn.functional.silu(xi @ wi)  # noqa: E731
        if overlapped:
            y, s = all_to_all_alongside(xi, [rows], [rows], nccl_one_rank, work)
        else:
            y, s = all_to_all_single_autograd(xi, [rows], [rows], nccl_one_rank), work()
        y = y + 0  # a plain tensor from the reference's lazily waited one
        ((y.float() * cot_y).sum() + (s.float() * cot_s).sum()).backward()
        return [y.detach(), s.detach(), xi.grad, wi.grad]

    ours, ref = run(True), run(False)
    torch.cuda.synchronize()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    assert ours[2].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", ["flat", "hierarchical"])
def test_expert_parallel_route_on_cuda_matches_the_plain_moe(nccl_one_rank, dispatch):
    """On CUDA (NCCL, one rank for the EP group and both levels), with the count exchanges started before the
    latent projection and read back through ``HostReadback``: the routed path's output and every gradient are the
    plain MoE's."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_overlapped_exchange import dispatch_by_node_on_one_rank
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import LatentMoE
    from titan_kimi.parallel.expert_parallel import _permutation_on_any_device, shard_flat

    torch.manual_seed(1)
    args = model_args_for("k3_debug", num_experts=16, moe_inter_dim=128, moe_latent_dim=128)
    plain = LatentMoE(args)
    plain.init_weights()
    plain = plain.to("cuda", torch.bfloat16)
    node = LatentMoE(args).to("cuda", torch.bfloat16)
    node.load_state_dict(plain.state_dict())
    if dispatch == "flat":
        _permutation_on_any_device()
        shard_flat(node.experts, init_device_mesh("cuda", (1,)))
    else:
        dispatch_by_node_on_one_rank(node, "cuda")
    x = torch.randn(2, 64, args.dim, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn_like(x)
    results = []
    for moe in (plain, node):
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.backward(cot)
        grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in moe.named_parameters()
                 if p.requires_grad}  # (the router's selection bias is not trained)
        results.append((out.detach(), xi.grad, grads))
    torch.cuda.synchronize()
    (out_p, dx_p, g_p), (out_n, dx_n, g_n) = results
    # bf16: the relay's fp32 sum over the node's experts runs in another order than the plain gather-sum
    assert rel_err(out_n, out_p) < 1e-2 and rel_err(dx_n, dx_p) < 1e-2
    assert g_p.keys() == g_n.keys()
    for name in g_p:
        assert g_p[name] is not None and rel_err(g_n[name], g_p[name]) < 1e-2, name


@pytest.mark.gpu
def test_host_readback_reads_the_values_of_its_queue_point():
    """The copy is queued where ``HostReadback`` is made: ``get`` returns the values then, not those of work
    queued after it, and waits for its kernel behind long ones (no read of an unfinished result)."""
    from titan_kimi.parallel.host_readback import HostReadback

    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):  # long work ahead of the value
        x = torch.tanh(x @ x / 64)
    values = x[:, :16].sum(0)
    pending = HostReadback(values)
    values.mul_(-1)  # queued after the copy: must not show in the read
    for _ in range(4):
        x = x @ x / 64
    got = pending.get()
    assert got == (-values).cpu().tolist()
