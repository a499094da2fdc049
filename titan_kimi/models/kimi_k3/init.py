"""The fp32-parameter policy: which parameters stay fp32 whatever the model dtype (the initial distributions:
``init_specs``)."""

from __future__ import annotations

import torch
import torch.nn as nn


def fp32_parameter_names(model: nn.Module) -> set[str]:
    """Fully qualified names of parameters that stay fp32 whatever the model dtype.

    Modules declare them in a ``fp32_params`` class attribute (A_log, dt_bias, the KDA convs, o_norm and
    the router bias), as the checkpoint and the spec require.
    """
    names = set()
    for module_name, module in model.named_modules():
        for param_name in getattr(module, "fp32_params", ()):
            names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def cast_model_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters to ``dtype`` except the fp32 ones."""
    keep = fp32_parameter_names(model)
    for name, param in model.named_parameters():
        target = torch.float32 if name in keep else dtype
        if param.is_floating_point() and param.dtype != target:
            param.data = param.data.to(target)
    return model
