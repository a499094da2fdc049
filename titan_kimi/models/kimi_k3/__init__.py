"""Kimi K3 / K3.1 text model."""

from titan_kimi.models.kimi_k3.accounting import ParamCounts, count_params, training_flops_per_token
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.flavors import flavor_names, model_args_for
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.models.kimi_k3.sequence import SequenceInfo, build_sequence_info

__all__ = [
    "KimiK3Model",
    "KimiK3ModelArgs",
    "ParamCounts",
    "SequenceInfo",
    "build_sequence_info",
    "count_params",
    "flavor_names",
    "model_args_for",
    "training_flops_per_token",
]
