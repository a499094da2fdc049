"""The fake-tensor activation estimate: what the CUDA kernels keep (not what the CPU math kernels would), the most
activations live at once, one EP rank's local experts."""

import pytest

from lowerings.catalog import BACKEND_OPS
from lowerings.ops.registry import planned_backends
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.parallel.activation_estimate import estimate_activations, local_expert_args


def test_dense_attention_is_estimated_as_a_fused_kernel_linear_in_tokens():
    """A fused attention kernel keeps O(tokens) for backward (q, k, v, the output, a log-sum-exp per row); the CPU
    math kernel keeps the [S, S] probabilities. Doubling the tokens of k3_debug (dense MLA layers) must about
    double the estimate (2.09x here; the S^2 probabilities made it 3.2x)."""
    args = model_args_for("k3_debug")
    kernels = planned_backends({op: "auto" for op in BACKEND_OPS})  # the shipped [kernels] section
    small, large = (estimate_activations(args, kernels=kernels, rows=1, seq_len=s, cp=1,
                                         cp_layout="zigzag")["activations"] for s in (2048, 4096))
    assert 1.9 < large / small < 2.3, (small, large)


def _activations(args, layer_range, *, rows=1, seq_len=16, ep=1) -> float:
    kernels = planned_backends({op: "auto" for op in BACKEND_OPS})
    return estimate_activations(args, kernels=kernels, rows=rows, seq_len=seq_len, cp=1, cp_layout="zigzag",
                                layer_range=layer_range, ac_mode="full", ep=ep)["activations"] * 2**30


def test_the_peak_is_the_most_activations_live_not_their_share_at_the_weights_peak():
    """Under full checkpointing every layer keeps at least its input until its backward, so 4 more layers keep
    at least 4 more inputs. On few tokens the gradients dominate, and parameters + gradients + activations peak at
    the end of the backward, when little is left: the activations read at that moment fell with more layers."""
    args = model_args_for("k31_debug_pp")  # 2-layer AttnRes blocks: stages of 2 and 6 layers
    one_input = 16 * args.dim * 2  # a 16-token row's hidden state in bf16
    two, six = _activations(args, (2, 4)), _activations(args, (2, 8))
    assert six - two >= 4 * one_input, (two / one_input, six / one_input)


def test_each_moe_layer_holds_one_ep_ranks_local_experts():
    """At EP4 a rank holds 16 of 64 experts: the weight-gradient temporaries of the 48 others (a w13 gradient
    each, the largest) are not on it. The experts never fall below top_k, so the router can choose its k."""
    args = model_args_for("k31_debug_pp", num_experts=64)
    w13 = 2 * args.moe_inter_dim * args.moe_latent_dim * 2
    assert _activations(args, (2, 4)) - _activations(args, (2, 4), ep=4) >= 0.99 * 48 * w13
    assert local_expert_args(args, 4).num_experts == 16 and local_expert_args(args, 64).num_experts == 2
    with pytest.raises(ValueError, match="expert parallel degree 3 does not divide the 64 experts"):
        local_expert_args(args, 3)
