"""LoRA for Kimi K3 / K3.1: adapters on linear layers, the lm_head and the stacked routed experts; target
patterns; freezing rules (the indexer and every base weight frozen); PEFT-layout save/load; merge-and-export."""

from titan_kimi.lora.apply import LoRASettings, apply_lora, targets_summary
from titan_kimi.lora.merge import merge_adapters_, merged_tensors
from titan_kimi.lora.modules import (
    LoRAGroupedExperts,
    LoRALinear,
    LoRALMHead,
    adapter_modules,
    add_adapter,
    is_adapter_parameter,
    reset_adapters,
)
from titan_kimi.lora.peft_io import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, load_adapters, save_adapters
from titan_kimi.lora.targets import DEFAULT_TARGETS, GROUPS, select_targets

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "DEFAULT_TARGETS",
    "GROUPS",
    "LoRAGroupedExperts",
    "LoRALMHead",
    "LoRALinear",
    "LoRASettings",
    "adapter_config",
    "adapter_modules",
    "add_adapter",
    "apply_lora",
    "is_adapter_parameter",
    "load_adapters",
    "merge_adapters_",
    "merged_tensors",
    "reset_adapters",
    "save_adapters",
    "select_targets",
    "targets_summary",
]
