"""The [kernels] section: the op list lives in lowerings/catalog.py alone, and kernel settings are config keys
(printed with the resolved config), never environment variables."""

import dataclasses

import pytest
import torch

from lowerings.catalog import BACKEND_OPS
from lowerings.kernels.launch import autotune_enabled
from lowerings.kernels.sparse_mla_fwd_ws import ws_forward_unsupported
from lowerings.ops.registry import _REGISTRY, op_backends
from lowerings.settings import KernelSettings, configure_kernel_settings, kernel_settings
from titan_kimi.config import ConfigError, load_job_config, to_toml
from titan_kimi.config.options import describe_config
from titan_kimi.config.sections import TRAINER_KERNEL_KEYS, JobConfig
from titan_kimi.training.setup.build import model_args_from_config
from titan_kimi.training.setup.kernels import configure_kernels


@pytest.fixture
def restore_settings():
    saved = kernel_settings()
    yield
    configure_kernel_settings(**dataclasses.asdict(saved))


def test_config_registry_and_catalog_list_the_same_ops_and_backends():
    import lowerings.ops  # noqa: F401  (every op module registers its backends)

    specs = describe_config(JobConfig)["kernels"]
    for op, entry in BACKEND_OPS.items():
        assert specs[op].choices == ("auto", *entry.backends)
        assert set(_REGISTRY[op].checks) == set(entry.backends), op  # every listed backend is registered
    assert set(_REGISTRY) == set(BACKEND_OPS)
    assert set(specs) == (set(BACKEND_OPS) | {f.name for f in dataclasses.fields(KernelSettings)}
                          | set(TRAINER_KERNEL_KEYS))
    with pytest.raises(ValueError, match=r"backend 'cutlass' of op 'kda' is not listed in lowerings/catalog\.py"):
        op_backends("kda").add("cutlass")
    with pytest.raises(ValueError, match=r"op 'indexer' is not listed in lowerings/catalog\.py"):
        op_backends("indexer")


def test_the_old_indexer_key_points_to_the_op_name():
    with pytest.raises(ConfigError, match=r"kernels.indexer = \"triton\" .*unknown key in \[kernels\] "
                                          r"\(did you mean kernels.indexer_topk\?\)"):
        load_job_config(["--kernels.indexer", "triton"], environ={})


def test_settings_are_config_keys_that_reach_the_kernels(restore_settings, monkeypatch):
    monkeypatch.delenv("TITAN_KIMI_TRITON_AUTOTUNE", raising=False)
    monkeypatch.delenv("TITAN_KIMI_SPARSE_MLA_WS", raising=False)
    cfg = load_job_config(["--kernels.triton_autotune", "false", "--kernels.sparse_mla_ws", "false",
                           "--kernels.fla_configs", "autotune"], environ={})
    text = to_toml(cfg)
    assert "triton_autotune = false" in text and "sparse_mla_ws = false" in text and 'fla_configs = "autotune"' in text
    resolved = configure_kernels(cfg.kernels, model_args_from_config(cfg))
    assert resolved["indexer_topk"] == "reference" or torch.cuda.is_available()
    assert (resolved["triton_autotune"], resolved["sparse_mla_ws"], resolved["fla_configs"]) == (False, False,
                                                                                                "autotune")
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert ws_forward_unsupported(q, torch.zeros(2, 576, dtype=torch.bfloat16), 512) == "kernels.sparse_mla_ws = false"
    default = load_job_config([], environ={})
    configure_kernels(default.kernels, model_args_from_config(default))
    assert kernel_settings() == KernelSettings()
    assert ws_forward_unsupported(q, torch.zeros(2, 576, dtype=torch.bfloat16), 512) == "not on CUDA"
    assert not autotune_enabled(q)  # a CPU tensor never autotunes


def test_the_replaced_environment_variables_are_refused(monkeypatch):
    monkeypatch.setenv("TITAN_KIMI_TRITON_AUTOTUNE", "0")
    default = load_job_config([], environ={})
    with pytest.raises(ValueError, match=r"TITAN_KIMI_TRITON_AUTOTUNE='0' -> kernels.triton_autotune "
                                         r"\(--kernels.triton_autotune false for =0\)"):
        configure_kernels(default.kernels, model_args_from_config(default))
    with pytest.raises(ValueError, match=r"kernels.fla_configs = 'always' is invalid; valid: \['shipped', 'autotune'\]"):
        configure_kernel_settings(fla_configs="always")


def test_backend_libraries_are_imported_for_the_chosen_backends_only(monkeypatch):
    from titan_kimi.training.setup import kernels

    monkeypatch.setattr(kernels, "_BACKEND_MODULES", {("kda", "fla"): (("json", "csv"), (), ()),
                                                      ("linear_cross_entropy", "liger"): (("no_such_module",), (), ())})
    assert kernels.import_backend_libraries({"kda": "fla", "linear_cross_entropy": "reference"}) == ["json", "csv"]
    with pytest.raises(ModuleNotFoundError):
        kernels.import_backend_libraries({"linear_cross_entropy": "liger"})
