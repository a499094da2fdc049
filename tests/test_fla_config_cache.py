"""Shipped FLA autotune configs (lowerings/kernels/fla_config_cache.py): dump/merge in FLA's file format, the
env selection made before fla is imported, and the CPU-testable parts of scripts/tools/tune_fla_configs.py.

Runs without fla installed (a fake autotuner in a fake ``fla.fake_mod`` module); where fla-core imports, the
files are also read back through FLA's own KernelConfigFile / load_cached_config / CachedAutotuner.
"""

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import triton
from triton.runtime.autotuner import Autotuner, Heuristics

from lowerings.kernels import fla_config_cache as fcc

ROOT = Path(__file__).resolve().parents[1]
ENV = ("FLA_CACHE_MODE", "FLA_CONFIG_DIR", "FLA_GPU_NAME")
KEY_A = (64, 128, True, "torch.bfloat16")
# FLA 0.6.0's AutotuneKey.key_hash(KEY_A), computed once with fla-core installed: pins the on-disk key format.
KEY_A_HASH = "7135fe7afe7584cbb3123df02b9615e0"


def fla_cache_module():
    """fla.ops.utils.cache if fla-core imports here, else None."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        import fla.ops.utils.cache as cache
    except Exception:  # installed but unusable on this machine
        return None
    return cache


@pytest.fixture
def clean_env():
    saved = {name: os.environ.pop(name) for name in ENV if name in os.environ}
    yield
    for name in ENV:
        os.environ.pop(name, None)
    os.environ.update(saved)


class FakeCachedAutotuner(Autotuner):
    """What dump_fla_configs sees of FLA's CachedAutotuner: a Triton Autotuner with kernel_name and cache."""

    def __init__(self, kernel_name, cache):  # no Autotuner.__init__: it needs a jitted kernel
        self.kernel_name = kernel_name
        self.cache = cache
        self.fn = None


def wrapped_in_heuristics(tuner):
    h = Heuristics.__new__(Heuristics)  # @triton.heuristics(...) over @autotune: the module attribute
    h.fn = tuner
    return h


@pytest.fixture
def fake_fla(monkeypatch):
    """Registers a module ``fla.fake_mod`` in sys.modules; returns a function installing tuners into it."""
    module = types.ModuleType("fla.fake_mod")
    monkeypatch.setitem(sys.modules, "fla.fake_mod", module)

    def install(**attrs):
        for name, value in attrs.items():
            setattr(module, name, value)

    return install


def read(path):
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------------------------- dump / load
def test_dump_writes_fla_format_with_fla_key_hashes(tmp_path, fake_fla):
    cfg_a = triton.Config({"BT": 64, "BK": 32}, num_warps=4, num_stages=2)
    cfg_b = triton.Config({"BT": 16, "USE_X": True, "P": None}, num_warps=8, num_stages=3)
    key_b = (16, 1024, False, "torch.float32")
    tuner = FakeCachedAutotuner("kda_fake_kernel", {KEY_A: cfg_a, key_b: cfg_b})
    other = FakeCachedAutotuner("other_fake_kernel", {(1,): triton.Config({"BV": 128}, num_warps=2, num_stages=1)})
    plain = Autotuner.__new__(Autotuner)  # triton.autotune without FLA: never reads configs, not dumped
    plain.cache = {(7,): cfg_a}
    fake_fla(direct=tuner, heur=wrapped_in_heuristics(other), same=tuner, plain=plain)

    assert fcc.dump_fla_configs(tmp_path / "out") == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["kda_fake_kernel.json", "other_fake_kernel.json"]
    data = read(tmp_path / "out" / "kda_fake_kernel.json")
    assert data["kernel_name"] == "kda_fake_kernel"
    assert data["triton_version"] == triton.__version__
    entries = data["autotune_entries"]
    assert entries[KEY_A_HASH] == {
        "autotune_key": [64, 128, True, "torch.bfloat16"],
        "config": {"kwargs": {"BT": 64, "BK": 32}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None},
    }
    assert len(entries) == 2
    (hash_b,) = set(entries) - {KEY_A_HASH}
    assert entries[hash_b]["config"]["kwargs"] == {"BT": 16, "USE_X": True, "P": None}
    # default_config: the entry with the largest product of numeric key values (16*1024 > 64*128)
    assert data["default_config"] == entries[hash_b]["config"]
    assert read(tmp_path / "out" / "other_fake_kernel.json")["autotune_entries"][fcc._key_hash([1])]["config"][
        "kwargs"] == {"BV": 128}


def test_dump_merges_with_existing_file(tmp_path, fake_fla):
    out = tmp_path / "cfg"
    out.mkdir()
    kept = {"autotune_key": [32, "torch.float16"], "config": {"kwargs": {"BT": 32}, "num_warps": 2, "num_stages": 1,
                                                                "num_ctas": 1, "maxnreg": None}}
    stale = {"autotune_key": list(KEY_A), "config": {"kwargs": {"BT": 8}, "num_warps": 1, "num_stages": 1,
                                                      "num_ctas": 1, "maxnreg": None}}
    (out / "k.json").write_text(json.dumps({"kernel_name": "k", "triton_version": triton.__version__,
                                            "autotune_entries": {"h_kept": kept, KEY_A_HASH: stale},
                                            "default_config": None}))
    fake_fla(t=FakeCachedAutotuner("k", {KEY_A: triton.Config({"BT": 128}, num_warps=8, num_stages=4)}))

    assert fcc.dump_fla_configs(out) == 1  # entries taken from the autotuners, not the ones kept
    entries = read(out / "k.json")["autotune_entries"]
    assert list(entries) == ["h_kept", KEY_A_HASH]
    assert entries["h_kept"] == kept
    assert entries[KEY_A_HASH]["config"]["kwargs"] == {"BT": 128}
    assert entries[KEY_A_HASH]["config"]["num_stages"] == 4
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("content, message", [
    ("{not json", "unreadable"),
    (json.dumps({"kernel_name": "k", "autotune_entries": [1, 2]}), "autotune_entries"),
    (json.dumps({"kernel_name": "k", "autotune_entries": {"h": {"autotune_key": [1]}}}), "autotune_entries"),
    (json.dumps({"kernel_name": "other", "autotune_entries": {}}), "kernel_name 'other'"),
])
def test_dump_refuses_to_merge_into_a_bad_file(tmp_path, fake_fla, content, message):
    (tmp_path / "k.json").write_text(content)
    fake_fla(t=FakeCachedAutotuner("k", {KEY_A: triton.Config({"BT": 64}, num_warps=4, num_stages=2)}))
    with pytest.raises(ValueError, match=message):
        fcc.dump_fla_configs(tmp_path)
    assert (tmp_path / "k.json").read_text() == content  # left as it was


def test_dump_bad_out_dir_and_nothing_tuned(tmp_path, fake_fla):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    fake_fla(t=FakeCachedAutotuner("k", {KEY_A: triton.Config({"BT": 64}, num_warps=4, num_stages=2)}))
    with pytest.raises(NotADirectoryError, match="not a directory"):
        fcc.dump_fla_configs(a_file)
    with pytest.raises(OSError):
        fcc.dump_fla_configs(a_file / "sub")  # a parent is a file
    fake_fla(t=FakeCachedAutotuner("k", {}))
    assert fcc.dump_fla_configs(tmp_path / "never") == 0
    assert not (tmp_path / "never").exists()


def test_dump_skips_keys_that_are_not_json_clean(tmp_path, fake_fla):
    good = triton.Config({"BT": 64}, num_warps=4, num_stages=2)
    fake_fla(t=FakeCachedAutotuner("k", {KEY_A: good, (object(),): good, (float("nan"),): good,
                                         (3,): triton.Config({"BT": object()}, num_warps=4, num_stages=2)}))
    assert fcc.dump_fla_configs(tmp_path) == 1
    assert list(read(tmp_path / "k.json")["autotune_entries"]) == [KEY_A_HASH]


def test_files_load_through_fla(tmp_path, monkeypatch, fake_fla, clean_env):
    cache = fla_cache_module()
    if cache is None:
        pytest.skip("fla-core is not importable here")
    import triton.language as tl

    @triton.jit
    def fake_tuned_kernel(x, D, BT: tl.constexpr):
        pass

    def make():
        return cache.fla_cache_autotune(configs=[triton.Config({"BT": 16}, num_warps=2),
                                                 triton.Config({"BT": 32}, num_warps=4)], key=["D"])(fake_tuned_kernel)

    tuned = make()
    assert isinstance(tuned, cache.CachedAutotuner) and tuned.kernel_name == "fake_tuned_kernel"
    key = (128, "torch.bfloat16")  # what AutotuneKey.build gives for D=128 and a bf16 tensor x
    tuned.cache[key] = triton.Config({"BT": 32}, num_warps=4, num_stages=3)  # as Triton's benchmark leaves it
    fake_fla(t=tuned)
    assert fcc.dump_fla_configs(tmp_path) == 1
    path = tmp_path / "fake_tuned_kernel.json"
    data = read(path)
    parsed = cache.KernelConfigFile.from_dict(path, data)
    assert parsed is not None and parsed.kernel_name == "fake_tuned_kernel"
    assert cache.AutotuneKey.key_hash(KEY_A) == KEY_A_HASH
    assert set(data["autotune_entries"]) == {cache.AutotuneKey.key_hash(key)}

    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    assert cache.load_cached_config("fake_tuned_kernel", cache.AutotuneKey(key))["kwargs"] == {"BT": 32}
    assert cache.load_cached_config("fake_tuned_kernel", cache.AutotuneKey((64, "torch.bfloat16"))) is None
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.FUZZY)
    fresh = make()  # a new process's autotuner: loads instead of tuning
    fresh.maybe_load_cached_config(cache.AutotuneKey((64, "torch.bfloat16")), nargs={}, runtime_kwargs={})
    loaded = fresh.cache[(64, "torch.bfloat16")]
    assert (loaded.kwargs, loaded.num_warps, loaded.num_stages) == ({"BT": 32}, 4, 3)
    assert cache.load_cached_config("fake_tuned_kernel", cache.AutotuneKey((64, "torch.float32", 1))) is None


# ------------------------------------------------------------------------------------------- env selection
def test_sanitize_matches_fla():
    names = ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "  AMD Instinct MI300X ", "--"]
    assert [fcc.sanitize_gpu_name(n) for n in names] == [
        "NVIDIA_H200", "NVIDIA_H100_80GB_HBM3", "AMD_Instinct_MI300X", "unknown_gpu"]
    cache = fla_cache_module()
    if cache is not None:
        assert [fcc.sanitize_gpu_name(n) for n in names] == [cache.sanitize_gpu_name(n) for n in names]


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    monkeypatch.setattr(fcc, "CONFIG_ROOT", tmp_path)
    path = tmp_path / "NVIDIA_H200"
    path.mkdir()
    (path / "some_kernel.json").write_text("{}")
    (tmp_path / "Empty_GPU").mkdir()
    return path


def test_shipped_config_dir(shipped, clean_env):
    assert fcc.shipped_config_dir("NVIDIA H200") == shipped
    assert fcc.shipped_config_dir("NVIDIA A100-SXM4-80GB") is None
    assert fcc.shipped_config_dir("Empty GPU") is None  # a directory without configs ships nothing
    if not __import__("torch").cuda.is_available():
        assert fcc.shipped_config_dir() is None  # no GPU, no FLA_GPU_NAME
    os.environ["FLA_GPU_NAME"] = "NVIDIA H200"
    assert fcc.shipped_config_dir() == shipped


def test_selects_shipped_configs_before_fla_import(shipped, clean_env, monkeypatch):
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    os.environ["FLA_GPU_NAME"] = "NVIDIA H200"
    assert fcc.use_shipped_fla_configs() == "fla configs: shipped NVIDIA_H200 (fuzzy)"
    assert os.environ["FLA_CONFIG_DIR"] == str(shipped)
    assert os.environ["FLA_CACHE_MODE"] == "fuzzy"
    # a second call sees the variables it set and changes nothing
    assert fcc.use_shipped_fla_configs().startswith("fla configs: user FLA_CACHE_MODE=fuzzy")
    assert os.environ["FLA_CONFIG_DIR"] == str(shipped)


def test_another_mode_for_shapes_without_an_entry(shipped, clean_env, monkeypatch):
    """The GPU tests without autotuning ask for FLA's ``full`` mode: its defaults where no entry matches."""
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    os.environ["FLA_GPU_NAME"] = "NVIDIA H200"
    assert fcc.use_shipped_fla_configs(mode="full") == "fla configs: shipped NVIDIA_H200 (full)"
    assert os.environ["FLA_CONFIG_DIR"] == str(shipped) and os.environ["FLA_CACHE_MODE"] == "full"


@pytest.mark.parametrize("user", [{"FLA_CACHE_MODE": "disabled"}, {"FLA_CONFIG_DIR": "/my/configs"},
                                  {"FLA_CACHE_MODE": "strict", "FLA_CONFIG_DIR": "/my/configs"}])
def test_user_settings_are_respected(shipped, clean_env, monkeypatch, user):
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    os.environ["FLA_GPU_NAME"] = "NVIDIA H200"
    os.environ.update(user)
    message = fcc.use_shipped_fla_configs()
    assert message.startswith("fla configs: user ")
    for name, value in user.items():
        assert f"{name}={value}" in message
    assert {n: os.environ.get(n) for n in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")} == {
        n: user.get(n) for n in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}


def test_no_configs_for_this_gpu_leaves_fla_autotuning(shipped, clean_env):
    os.environ["FLA_GPU_NAME"] = "NVIDIA B200"
    assert fcc.use_shipped_fla_configs() == "fla configs: none shipped for NVIDIA_B200, FLA autotunes"
    assert "FLA_CACHE_MODE" not in os.environ and "FLA_CONFIG_DIR" not in os.environ


def test_no_gpu(shipped, clean_env, monkeypatch):
    monkeypatch.setattr(fcc, "current_gpu_name", lambda: None)
    assert fcc.use_shipped_fla_configs() == "fla configs: no CUDA device, FLA autotunes"
    assert "FLA_CACHE_MODE" not in os.environ and "FLA_CONFIG_DIR" not in os.environ


def test_too_late_when_fla_is_already_imported(shipped, clean_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    os.environ["FLA_GPU_NAME"] = "NVIDIA H200"
    message = fcc.use_shipped_fla_configs()
    assert "NOT used" in message and "fla was imported" in message and str(shipped) in message
    assert "FLA_CACHE_MODE" not in os.environ and "FLA_CONFIG_DIR" not in os.environ


def test_the_adapter_sets_nothing_at_import_and_follows_the_setting(shipped, clean_env, monkeypatch):
    import importlib

    from lowerings.kernels import fla_kda
    from lowerings.settings import configure_kernel_settings

    monkeypatch.delitem(sys.modules, "fla", raising=False)
    os.environ["FLA_GPU_NAME"] = "NVIDIA H200"
    importlib.reload(fla_kda)
    assert "FLA_CACHE_MODE" not in os.environ and "FLA_CONFIG_DIR" not in os.environ  # no import side effect
    previous = configure_kernel_settings().fla_configs
    try:
        configure_kernel_settings(fla_configs="autotune")
        assert fla_kda.prepare_fla_configs() == "fla configs: none (kernels.fla_configs = autotune), FLA autotunes"
        assert "FLA_CACHE_MODE" not in os.environ
        importlib.reload(fla_kda)
        configure_kernel_settings(fla_configs="shipped")
        assert fla_kda.prepare_fla_configs() == "fla configs: shipped NVIDIA_H200 (fuzzy)"
        assert fla_kda.prepare_fla_configs() == "fla configs: shipped NVIDIA_H200 (fuzzy)"  # applied once
        assert os.environ["FLA_CACHE_MODE"] == "fuzzy"
    finally:
        configure_kernel_settings(fla_configs=previous)
        importlib.reload(fla_kda)


# ----------------------------------------------------------------------------------- scripts/tune_fla_configs
def load_script():
    spec = importlib.util.spec_from_file_location("tune_fla_configs", ROOT / "scripts" / "tools" / "tune_fla_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_script_shapes(clean_env, capsys):
    script = load_script()
    opts = script.parse_args(["--heads", "16", "96", "--seq-lens", "4096", "8192", "--varlen-docs", "3"])
    assert script.cases(opts) == [(16, 4096, 3), (16, 4096, 0), (16, 8192, 3), (16, 8192, 0),
                                  (96, 4096, 3), (96, 4096, 0), (96, 8192, 3), (96, 8192, 0)]
    assert script.cases(script.parse_args(["--varlen-docs", "0"])) == [(16, 8192, 0), (24, 8192, 0), (96, 8192, 0)]
    for T, n in [(8192, 8), (100, 1), (5, 5)]:
        cu = script.doc_boundaries(T, n)
        assert len(cu) == n + 1 and cu[0] == 0 and cu[-1] == T
        assert all(a < b for a, b in zip(cu, cu[1:]))
    with pytest.raises(SystemExit):
        script.parse_args(["--varlen-docs", "9000"])
    capsys.readouterr()
    if not __import__("torch").cuda.is_available():
        assert script.main(["--no-check"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        assert "FLA_CACHE_MODE" not in os.environ


def test_shipped_h200_configs_are_valid():
    """The configs in the repository (tuned on an H200 at the k31_small KDA shapes) are in FLA's format, each
    entry's hash is the hash of its key, and the H200 directory is what a user's H200 selects."""
    root = Path(fcc.__file__).parent / "fla_configs" / "NVIDIA_H200"
    files = sorted(root.glob("*.json"))
    assert len(files) >= 10, files
    assert fcc.shipped_config_dir("NVIDIA H200") == root
    cache = fla_cache_module()
    for path in files:
        data = read(path)
        assert data["kernel_name"] == path.stem and data["autotune_entries"], path
        for h, entry in data["autotune_entries"].items():
            cfg = entry["config"]
            assert isinstance(cfg["kwargs"], dict) and cfg["num_warps"] in (1, 2, 4, 8, 16, 32), (path, cfg)
            if cache is not None:
                assert cache.AutotuneKey.key_hash(tuple(entry["autotune_key"])) == h
        if cache is not None:
            assert cache.KernelConfigFile.from_dict(path, data) is not None
