"""Job-config loading, overrides, printing and validation errors (no torch needed)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from titan_kimi.config import (ConfigError, JobConfig, format_help, known_flavors, load_job_config,
                               to_dict, to_toml, validate_job_config)
from titan_kimi.config.options import describe_config
from titan_kimi.config.validation import FLAVORS_MODULE, VISION_FLAVORS_MODULE

NO_LAUNCHER: dict[str, str] = {}  # keeps a WORLD_SIZE in the test environment out of the checks
FAKE_FLAVORS = ["k3_debug", "k31_debug", "k3_small", "k31_small"]
REAL_REGISTRY_TESTS = {"test_real_registry_knows_the_default_flavor", "test_real_registry_rejects_unknown_flavor"}


@pytest.fixture(autouse=True)
def fake_flavor_registry(request, monkeypatch):
    """Stands in for the model's flavor registry (whose package imports torch) so these tests stay torch-free."""
    if request.function.__name__ in REAL_REGISTRY_TESTS:
        return
    registry = types.ModuleType(FLAVORS_MODULE)
    registry.flavor_names = lambda: list(FAKE_FLAVORS)
    monkeypatch.setitem(sys.modules, FLAVORS_MODULE, registry)
    vision = types.ModuleType(VISION_FLAVORS_MODULE)
    vision.vision_flavor_names = lambda: ["moonvit3d", "moonvit3d_debug"]
    monkeypatch.setitem(sys.modules, VISION_FLAVORS_MODULE, vision)


def load(*argv: str, environ: dict[str, str] | None = None) -> JobConfig:
    return load_job_config(list(argv), environ=NO_LAUNCHER if environ is None else environ)


def write_toml(tmp_path: Path, text: str, name: str = "recipe.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- loading and precedence

def test_defaults_load_and_match_declarations():
    cfg = load()
    assert list(to_dict(cfg)) == ["job", "model", "training", "optimizer", "lr_scheduler", "parallelism",
                                  "checkpoint", "activation_checkpoint", "compile", "kernels", "data",
                                  "metrics", "validation", "profiling", "lora", "step_time", "indexer"]
    assert cfg.job.dump_folder == "./outputs" and cfg.job.seed == 1234 and cfg.job.world_size == 0
    assert cfg.model.name == "kimi_k3" and cfg.model.flavor == "k31_debug" and cfg.model.dtype == "bfloat16"
    assert cfg.training.loss_chunk_size == 512 and cfg.training.global_batch_size == -1
    assert cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.parallelism.data_parallel_shard_degree == -1 and cfg.parallelism.tensor_parallel_degree == 1
    assert cfg.metrics.peak_flops == 989e12 and cfg.metrics.save_jsonl is True
    assert cfg.lora.enable is False and cfg.profiling.enable is False and cfg.profiling.steps == [-1]
    assert cfg.indexer.mode == "frozen" and cfg.model.add_indexer is False
    for section, specs in describe_config(JobConfig).items():
        for name, spec in specs.items():
            assert getattr(getattr(cfg, section), name) == spec.default, spec.path
            assert spec.help, f"{spec.path} has no meaning for --help"


def test_default_lists_are_not_shared_between_configs():
    first, second = JobConfig(), JobConfig()
    first.optimizer.betas.append(0.5)
    assert second.optimizer.betas == [0.9, 0.95]


def test_toml_then_command_line_precedence(tmp_path):
    recipe = write_toml(tmp_path, """
[training]
steps = 20
local_batch_size = 4
[optimizer]
lr = 1e-3
betas = [0.8, 0.9]
[checkpoint]
enable = true
""")
    # The override comes before --job.config_file on the command line and still wins.
    cfg = load("--training.steps", "30", "--job.config_file", recipe, "--optimizer.lr=2e-4")
    assert cfg.job.config_file == recipe
    assert cfg.training.steps == 30                 # command line beats TOML
    assert cfg.optimizer.lr == 2e-4                 # command line (= form) beats TOML
    assert cfg.training.local_batch_size == 4       # TOML beats default
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.checkpoint.enable is True
    assert cfg.training.seq_len == 2048             # default untouched


def test_override_forms_and_value_parsing():
    cfg = load("--optimizer.betas", "0.85, 0.99", "--compile.components=loss",
               "--checkpoint.enable", "--data.shuffle", "false", "--metrics.save_jsonl=False",
               "--training.max_norm", "2", "--optimizer.eps=1e-6", "--job.seed", "7",
               "--parallelism.data-parallel-shard-degree", "-1", "--activation-checkpoint.mode", "full",
               "--lora.target_modules", "")
    assert cfg.optimizer.betas == [0.85, 0.99]
    assert cfg.compile.components == ["loss"]
    assert cfg.checkpoint.enable is True            # a bare bool flag means true
    assert cfg.data.shuffle is False and cfg.metrics.save_jsonl is False
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.optimizer.eps == 1e-6
    assert cfg.job.seed == 7 and isinstance(cfg.job.seed, int)
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.activation_checkpoint.mode == "full"
    assert cfg.lora.target_modules == []


def test_list_override_accepts_brackets():
    assert load("--optimizer.betas=[0.5, 0.75]").optimizer.betas == [0.5, 0.75]


def test_bare_bool_flag_followed_by_another_flag():
    cfg = load("--job.dry_run", "--job.print_config", "--training.steps", "3")
    assert cfg.job.dry_run and cfg.job.print_config and cfg.training.steps == 3


def test_toml_int_is_accepted_for_float(tmp_path):
    cfg = load("--job.config_file", write_toml(tmp_path, "[optimizer]\nlr = 0\nweight_decay = 1\n"))
    assert cfg.optimizer.lr == 0.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.weight_decay == 1.0


def test_last_override_wins():
    assert load("--training.steps", "3", "--training.steps=4").training.steps == 4


def test_to_toml_round_trips(tmp_path):
    cfg = load("--training.steps", "12", "--optimizer.betas", "0.5,0.6", "--data.dataset", "hellaswag",
               "--job.description", 'quote " and \\ backslash', "--compile.mode", "inductor")
    recipe = write_toml(tmp_path, to_toml(cfg), "dumped.toml")
    again = load("--job.config_file", recipe)
    expected, actual = to_dict(cfg), to_dict(again)
    assert actual["job"].pop("config_file") == recipe
    expected["job"].pop("config_file")
    assert actual == expected


def test_launcher_world_size_resolves_the_shard_degree():
    argv = ("--parallelism.expert_parallel_degree", "4", "--training.global_batch_size", "16",
            "--training.local_batch_size", "2")
    # 8 ranks: shard degree 8, EP 4 divides it and 16 = 2 * 8 sequences per step.
    assert load(*argv, environ={"WORLD_SIZE": "8"}).training.global_batch_size == 16
    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 4 .*a divisor of 6"):
        load(*argv, environ={"WORLD_SIZE": "6"})


# ---------------------------------------------------------------- help

def test_help_lists_every_key_with_type_and_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_job_config(["--training.steps", "5", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed == format_help()
    for section, specs in describe_config(JobConfig).items():
        assert f"[{section}]" in printed
        for spec in specs.values():
            line = next(line for line in printed.splitlines() if line.strip().startswith(f"--{spec.path} "))
            assert spec.type_name() in line and "default:" in line, line
    assert '--training.loss_chunk_size (int, default: 512)' in printed
    assert '--optimizer.betas (list[float], default: [0.9, 0.95])' in printed
    assert "one of auto|reference|fla|cudnn" in printed   # choices are listed


def test_short_help_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_job_config(["-h"])
    assert exit_info.value.code == 0
    assert "--parallelism.expert_parallel_degree" in capsys.readouterr().out


def test_help_and_config_errors_do_not_import_torch():
    code = ("import sys\n"
            "from titan_kimi.config import ConfigError, format_help, load_job_config\n"
            "format_help()\n"
            "try:\n"
            "    load_job_config(['--training.steps', '0'], environ={})\n"
            "except ConfigError:\n"
            "    pass\n"
            "assert 'torch' not in sys.modules, 'the config layer imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# ---------------------------------------------------------------- bad configs

# (TOML text or None, extra argv, fragments the message must contain). "{toml}" stands for the TOML path.
BAD_CONFIGS = {
    "bad_toml_syntax": ("[training\nsteps = 3\n", [], ["{toml}", "invalid TOML", "line 1"]),
    "unknown_section": ("[trainig]\nsteps = 3\n", [],
                        ["trainig.steps", "{toml}", "unknown section [trainig]", "did you mean training.steps",
                         "sections job, model, training"]),
    "unknown_key_with_suggestion": ("[training]\nstepz = 3\n", [],
                                    ["training.stepz = 3", "{toml}", "did you mean training.steps?",
                                     "keys of [training]: steps"]),
    "key_in_wrong_section": ("[training]\nlr = 0.1\n", [], ["training.lr", "{toml}", "did you mean optimizer.lr?"]),
    "key_outside_section": ("steps = 3\n", [], ["steps = 3", "{toml}", "[section]", "[training] steps"]),
    "string_for_int": ('[training]\nsteps = "ten"\n', [],
                       ['training.steps = "ten"', "{toml}", "expected an integer, got a string", "an integer >= 1"]),
    "float_for_int_in_toml": ("[training]\nseq_len = 1024.0\n", [],
                              ["training.seq_len = 1024.0", "{toml}", "got a float", "an integer >= 1"]),
    "float_for_int_on_cli": (None, ["--training.local_batch_size", "2.5"],
                             ['training.local_batch_size = "2.5"', "command line", "a float, not an integer",
                              "an integer >= 1"]),
    "bool_for_int": ("[metrics]\nlog_freq = true\n", [],
                     ["metrics.log_freq = true", "{toml}", "got a boolean", "an integer >= 1"]),
    "list_for_scalar": ("[optimizer]\nlr = [0.1]\n", [],
                        ["optimizer.lr = [0.1]", "{toml}", "expected a number, got a list", "a number >= 0"]),
    "scalar_for_list": ("[optimizer]\nbetas = 0.9\n", [],
                        ["optimizer.betas = 0.9", "{toml}", "expected a list", "a list of 2 numbers in [0, 1)"]),
    "table_for_scalar": ("[training.steps]\nvalue = 3\n", [],
                         ["training.steps", "{toml}", "got a table", "an integer >= 1"]),
    "bad_enum": ('[kernels]\nsparse_mla = "flashmla"\n', [],
                 ['kernels.sparse_mla = "flashmla"', "{toml}", 'did you mean "flash_mla"?',
                  "one of auto|dense|reference|triton|cudnn|flash_mla"]),
    "bad_enum_case": (None, ["--optimizer.name", "adamw"],
                      ['optimizer.name = "adamw"', "command line", 'did you mean "AdamW"', "one of AdamW|Adam"]),
    "negative_steps": (None, ["--training.steps", "-5"],
                       ["training.steps = -5", "command line", "out of range", "an integer >= 1"]),
    "negative_batch": ("[training]\nlocal_batch_size = -2\n", [],
                       ["training.local_batch_size = -2", "{toml}", "an integer >= 1"]),
    "zero_loss_chunk": (None, ["--training.loss_chunk_size=0"],
                        ["training.loss_chunk_size = 0", "command line", "an integer >= 1"]),
    "warmup_longer_than_run": ("[training]\nsteps = 10\n", ["--lr_scheduler.warmup_steps", "11"],
                               ["lr_scheduler.warmup_steps = 11", "command line", "training.steps = 10",
                                "{toml}", "0..10"]),
    "decay_does_not_fit": ("[training]\nsteps = 100\n[lr_scheduler]\nwarmup_steps = 50\ndecay_ratio = 0.6\n", [],
                           ["lr_scheduler.decay_ratio = 0.6", "{toml}", "lr_scheduler.warmup_steps = 50",
                            "-1 or in [0, 0.5]"]),
    "betas_out_of_range": ("[optimizer]\nbetas = [0.9, 1.0]\n", [],
                           ["optimizer.betas = [0.9, 1.0]", "{toml}", "element 1 (1.0) is out of range",
                            "in [0, 1)"]),
    "betas_wrong_length": (None, ["--optimizer.betas", "0.9"],
                           ["optimizer.betas = [0.9]", "has 1 element, needs 2", "a list of 2 numbers"]),
    "bad_list_element": (None, ["--optimizer.betas", "0.9,x"],
                         ['optimizer.betas = "0.9,x"', "command line", 'element 1 ("x"): not a number',
                          "a list of 2 numbers in [0, 1)"]),
    "bad_list_choice": ('[compile]\ncomponents = ["model", "optimizer"]\n', [],
                        ["compile.components", "{toml}", 'element 1 ("optimizer") is not a valid choice',
                         "from model|loss"]),
    "negative_lr": ("[optimizer]\nlr = -0.001\n", [], ["optimizer.lr = -0.001", "{toml}", "a number >= 0"]),
    "nonfinite_float": ("[optimizer]\nlr = nan\n", [], ["optimizer.lr = nan", "{toml}", "not finite"]),
    "tensor_parallel": (None, ["--parallelism.tensor_parallel_degree", "2"],
                        ["parallelism.tensor_parallel_degree = 2", "command line", "exactly 1",
                         "Tensor parallelism is not supported", "context parallelism"]),
    "lora_without_targets": ("[lora]\nenable = true\n", ["--lora.target_modules="],
                             ["lora.target_modules = []", "command line", "adapts nothing"]),
    "adapters_without_lora": (None, ["--lora.adapter_path", "."],
                              ['lora.adapter_path = "."', "lora.enable = false", "lora.enable = true"]),
    "medpix_without_vision": ('[data]\ndataset = "medpix"\n', [],
                              ['model.vision_flavor = ""', 'data.dataset = "medpix"', "moonvit3d"]),
    "unknown_vision_flavor": (None, ["--model.vision_flavor", "vit_huge"],
                              ['model.vision_flavor = "vit_huge"', "not a known vision flavor", "moonvit3d_debug"]),
    "image_bounds_reversed": (None, ["--data.image_min_pixels", "10000", "--data.image_max_pixels", "5000"],
                              ["data.image_min_pixels = 10000", "data.image_max_pixels = 5000", "at most 5000"]),
    "missing_config_file": (None, ["--job.config_file", "/nonexistent/recipe.toml"],
                            ['job.config_file = "/nonexistent/recipe.toml"', "command line", "no such file",
                             "TOML recipe"]),
    "override_unknown_key": (None, ["--training.lr", "0.1"],
                             ['training.lr = "0.1"', "command line", "did you mean optimizer.lr?"]),
    "override_without_section": (None, ["--steps", "3"],
                                 ['steps = "3"', "command line", "did you mean training.steps?"]),
    "value_missing_after_flag": (None, ["--training.steps", "--job.dry_run"],
                                 ["training.steps", "command line", "value missing after --training.steps",
                                  "an integer >= 1"]),
    "value_missing_at_end": (None, ["--optimizer.lr"], ["optimizer.lr", "value missing", "a number >= 0"]),
    "stray_argument": (None, ["train_configs/x.toml"], ["command line", "'train_configs/x.toml'", "--section.key"]),
    "bad_bool": (None, ["--checkpoint.enable", "maybe"],
                 ['checkpoint.enable = "maybe"', "command line", "not a boolean", "true or false"]),
    "recipe_names_itself": ('[job]\nconfig_file = "other.toml"\n', [],
                            ['job.config_file = "other.toml"', "{toml}", "command line"]),
    "keep_latest_one": ("[checkpoint]\nkeep_latest_k = 1\n", [],
                        ["checkpoint.keep_latest_k = 1", "{toml}", "0, or an integer >= 2"]),
    "selective_ac_option": (None, ["--activation_checkpoint.selective_ac_option", "every2"],
                            ['activation_checkpoint.selective_ac_option = "every2"', "command line", '"op"',
                             "digits"]),
    "uncheckpointed_without_checkpointing": (None, ["--activation_checkpoint.uncheckpointed_blocks", "2"],
                                             ["activation_checkpoint.uncheckpointed_blocks = 2",
                                              'activation_checkpoint.mode = "none"', '"full"', '"mixers"']),
    "uncheckpointed_under_every_nth": (None, ["--activation_checkpoint.mode", "selective",
                                              "--activation_checkpoint.selective_ac_option", "3",
                                              "--activation_checkpoint.uncheckpointed_blocks", "1"],
                                       ["activation_checkpoint.uncheckpointed_blocks = 1",
                                        'activation_checkpoint.selective_ac_option = "3"']),
    "uncheckpointed_negative": (None, ["--activation_checkpoint.mode", "full",
                                       "--activation_checkpoint.uncheckpointed_blocks", "-1"],
                                ["activation_checkpoint.uncheckpointed_blocks = -1", ">= 0"]),
    "compile_nothing": (None, ["--compile.mode", "default", "--compile.components="],
                        ["compile.components = []", 'compile.mode = "default"', "model|loss"]),
    "module_compile_with_checkpointing": (None, ["--compile.mode", "default", "--compile.granularity", "module",
                                                 "--activation_checkpoint.mode", "full"],
                                          ['compile.granularity = "module"', 'activation_checkpoint.mode = "full"',
                                           '"block"']),
    "cuda_graphs_with_checkpointing": (None, ["--compile.mode", "reduce-overhead", "--activation_checkpoint.mode",
                                              "full"],
                                       ['compile.mode = "reduce-overhead"', 'activation_checkpoint.mode = "full"',
                                        "pytorch/pytorch#154306", '"default"']),
    "cuda_graphs_with_pipeline": (None, ["--compile.mode", "reduce-overhead", "--parallelism.pipeline_parallel_degree",
                                         "2", "--job.world_size", "2"],
                                  ['compile.mode = "reduce-overhead"', "parallelism.pipeline_parallel_degree = 2",
                                   "new CUDA-graph generation", '"default"']),
    "duplicate_list_entries": (None, ["--compile.components", "model,model"],
                               ["compile.components", "lists model more than once"]),
    "global_batch_not_multiple": ("[training]\nlocal_batch_size = 4\nglobal_batch_size = 6\n", [],
                                  ["training.global_batch_size = 6", "{toml}", "training.local_batch_size = 4"]),
    "context_parallel_split": (None, ["--training.seq_len", "100", "--parallelism.context_parallel_degree", "3"],
                               ["training.seq_len = 100", "parallelism.context_parallel_degree = 3",
                                'parallelism.context_parallel_layout = "zigzag"', "6 equal chunks",
                                "a multiple of 6"]),
    "context_parallel_split_contiguous": (None, ["--training.seq_len", "100", "--parallelism.context_parallel_degree",
                                                 "3", "--parallelism.context_parallel_layout", "contiguous"],
                                          ["training.seq_len = 100", "a multiple of 3"]),
    "context_parallel_layout_unknown": (None, ["--parallelism.context_parallel_layout", "ring"],
                                        ["parallelism.context_parallel_layout", "ring", "zigzag", "contiguous"]),
    "microbatch_does_not_divide": (None, ["--parallelism.pipeline_parallel_degree", "2",
                                          "--training.local_batch_size", "3",
                                          "--parallelism.pipeline_parallel_microbatch_size", "2"],
                                   ["parallelism.pipeline_parallel_microbatch_size = 2",
                                    "training.local_batch_size = 3", "a divisor of 3"]),
    "compute_dtype_wider_than_params": (None, ["--training.param_dtype", "float32"],
                                        ['training.param_dtype = "float32"', 'model.dtype = "bfloat16"',
                                         "the default"]),
    "hf_save_with_optimizer": (None, ["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
                                      "false"],
                               ["checkpoint.last_save_model_only = false", "checkpoint.last_save_in_hf = true"]),
    "missing_data_path": ('[data]\npath = "/nonexistent/corpus.jsonl"\n', [],
                          ['data.path = "/nonexistent/corpus.jsonl"', "{toml}", "no such file or folder",
                           "an existing file"]),
    "synthetic_with_path": ('[data]\ndataset = "synthetic"\n', ["--data.path", "."],
                            ['data.path = "."', 'data.dataset = "synthetic"', "{toml}", "is never read"]),
    "constant_decay_with_ratio": (None, ["--lr_scheduler.decay_type", "constant",
                                         "--lr_scheduler.decay_ratio", "0.5"],
                                  ["lr_scheduler.decay_ratio = 0.5", 'lr_scheduler.decay_type = "constant"']),
    "parallel_degrees_do_not_divide_world": (None, ["--job.world_size", "6",
                                                    "--parallelism.pipeline_parallel_degree", "4"],
                                             ["parallelism.pipeline_parallel_degree = 4", "world size 6",
                                              "multiply to 4"]),
    "experts_do_not_divide": (None, ["--job.world_size", "8", "--parallelism.expert_parallel_degree", "3"],
                              ["parallelism.expert_parallel_degree = 3", "command line", "a divisor of 8"]),
    "gradient_sync_unknown": (None, ["--parallelism.pipeline_gradient_sync", "layer"],
                              ['parallelism.pipeline_gradient_sync = "layer"', "command line", "step|microbatch"]),
    "gradient_sync_without_pipeline": (None, ["--parallelism.pipeline_gradient_sync", "microbatch"],
                                       ['parallelism.pipeline_gradient_sync = "microbatch"',
                                        "parallelism.pipeline_parallel_degree = 1", "step without pipeline"]),
    "gradient_sync_with_split_backward": (None, ["--parallelism.pipeline_gradient_sync", "microbatch",
                                                 "--parallelism.pipeline_parallel_degree", "2",
                                                 "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
                                          ['parallelism.pipeline_gradient_sync = "microbatch"',
                                           'parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"',
                                           "1F1B, GPipe, Interleaved1F1B, LoopedBFS"]),
    "hierarchical_dispatch_without_ep": (None, ["--parallelism.expert_parallel_dispatch", "hierarchical"],
                                         ['parallelism.expert_parallel_dispatch = "hierarchical"',
                                          "parallelism.expert_parallel_degree = 1", "flat"]),
    "hierarchical_dispatch_within_one_node": (None, ["--parallelism.expert_parallel_dispatch", "hierarchical",
                                                     "--parallelism.expert_parallel_degree", "4",
                                                     "--parallelism.expert_parallel_node_size", "4"],
                                              ["parallelism.expert_parallel_node_size = 4",
                                               "expert_parallel_degree 4 is not 2+ whole nodes of 4 ranks",
                                               "or the flat dispatch"]),
    "node_size_with_flat_dispatch": (None, ["--parallelism.expert_parallel_node_size", "8"],
                                     ["parallelism.expert_parallel_node_size = 8", "is never read",
                                      'parallelism.expert_parallel_dispatch = "flat"']),
    "shard_degree_mismatch": (None, ["--job.world_size", "4", "--parallelism.data_parallel_shard_degree", "3"],
                              ["parallelism.data_parallel_shard_degree = 3", "-1 or 4"]),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_rejected_with_a_useful_message(tmp_path, name):
    toml_text, argv, fragments = BAD_CONFIGS[name]
    args = list(argv)
    toml_path = ""
    if toml_text is not None:
        toml_path = write_toml(tmp_path, toml_text)
        args = ["--job.config_file", toml_path] + args
    with pytest.raises(ConfigError) as error_info:
        load(*args)
    message = str(error_info.value)
    assert isinstance(error_info.value, ValueError)
    for fragment in fragments:
        assert fragment.replace("{toml}", toml_path) in message, f"{fragment!r} not in: {message}"


def test_enough_distinct_bad_configs():
    assert len(BAD_CONFIGS) >= 15


def test_error_carries_key_source_and_value(tmp_path):
    recipe = write_toml(tmp_path, "[training]\nsteps = 0\n")
    with pytest.raises(ConfigError) as error_info:
        load("--job.config_file", recipe)
    assert (error_info.value.key, error_info.value.source, error_info.value.value) == ("training.steps", recipe, 0)


def test_validate_catches_configs_built_in_code():
    cfg = JobConfig()
    validate_job_config(cfg)
    cfg.training.steps = "10"
    with pytest.raises(ConfigError, match=r'training.steps = "10" \(set on the JobConfig object\): expected int'):
        validate_job_config(cfg)
    cfg.training.steps = 10
    cfg.optimizer.betas = (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"optimizer.betas .*expected list\[float\], got tuple"):
        validate_job_config(cfg)


def test_job_world_size_must_match_launcher():
    with pytest.raises(ConfigError, match=r"job.world_size = 8 .*launcher started 4 ranks.*0 or 4"):
        load("--job.world_size", "8", environ={"WORLD_SIZE": "4"})


def test_launcher_world_size_checks_degrees():
    with pytest.raises(ConfigError, match=r"does not divide world size 4 \(WORLD_SIZE from the launcher\)"):
        load("--parallelism.pipeline_parallel_degree", "3", environ={"WORLD_SIZE": "4"})


def test_bad_launcher_world_size():
    with pytest.raises(ConfigError, match="WORLD_SIZE = 'four'"):
        load(environ={"WORLD_SIZE": "four"})


def test_initial_load_of_safetensors_must_be_model_only(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_model_only = false .*safetensors folder"):
        load("--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_model_only=false")
    assert load("--checkpoint.initial_load_path", str(tmp_path)).checkpoint.initial_load_path == str(tmp_path)
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_model_only = false .*: loading the optimizer, "
                                          r"schedule and data state .* is not built.*valid: true\. To continue a run"):
        load("--checkpoint.initial_load_path", str(tmp_path / "step-3"), "--checkpoint.initial_load_model_only=false")


def test_hf_config_path_must_be_a_file(tmp_path):
    with pytest.raises(ConfigError, match=r"model.hf_config_path = .* is a folder; valid: an existing file"):
        load("--model.hf_config_path", str(tmp_path))
    config_json = tmp_path / "config.json"
    config_json.write_text("{}")
    assert load("--model.hf_config_path", str(config_json)).model.hf_config_path == str(config_json)


# ---------------------------------------------------------------- the flavor registry hook

def test_unknown_flavor_is_rejected_by_the_registry():
    assert load("--model.flavor", "k3_small").model.flavor == "k3_small"
    with pytest.raises(ConfigError) as error_info:
        load("--model.flavor", "k3_smal")
    message = str(error_info.value)
    assert 'model.flavor = "k3_smal"' in message and "command line" in message
    assert "one of " + "|".join(FAKE_FLAVORS) in message


def test_real_registry_knows_the_default_flavor():
    assert JobConfig().model.flavor in known_flavors()


def test_real_registry_rejects_unknown_flavor():
    names = known_flavors()
    with pytest.raises(ConfigError) as error_info:
        load("--model.flavor", "no_such_flavor")
    message = str(error_info.value)
    assert "model.flavor" in message and '"no_such_flavor"' in message
    for name in names:
        assert name in message


def test_a_torch_adam_implementation_needs_moments_in_the_parameter_dtype():
    with pytest.raises(ConfigError, match=r'optimizer.implementation = "fused" \(from the command line\): torch\'s fused '
                                          r'Adam keeps the moments in the parameter dtype \(model.dtype = "bfloat16" '
                                          r'\(the default\)\), so it cannot keep optimizer.state_dtype = "float32".*'
                                          r'valid: "auto"'):
        load("--optimizer.implementation", "fused")
    assert load("--optimizer.implementation", "fused", "--optimizer.state_dtype", "bfloat16")
    assert load("--optimizer.implementation", "foreach", "--model.dtype", "float32")


def test_validation_of_user_data_needs_a_validation_file(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match=r'data.validation_path = "" \(the default\): "" is the bundled sample\'s '
                                          r'validation split, but the training data is data.path = ".*train.jsonl" '
                                          r'\(from the command line\); valid: a validation file for that data'):
        load("--data.path", str(data), "--validation.enable")
    assert load("--data.path", str(data), "--validation.enable", "--data.validation_path", str(data))
    assert load("--validation.enable")  # the bundled sample has its own validation split


def test_paths_of_the_wrong_kind_are_caught_by_the_config(tmp_path):
    (tmp_path / "file.jsonl").write_text("{}\n")
    cases = [
        (["--data.path", str(tmp_path)], r"data.path = .* \(from the command line\): is a folder; valid: an existing file"),
        (["--data.validation_path", str(tmp_path)], r"data.validation_path = .*: is a folder; valid: an existing file"),
        (["--model.tokenizer_path", str(tmp_path / "file.jsonl")],
         r"model.tokenizer_path = .*file\.jsonl\" \(from the command line\): is a file; valid: an existing folder"),
        (["--checkpoint.initial_load_path", str(tmp_path)],
         r"checkpoint.initial_load_path = .*: is neither a DCP checkpoint step \(no \.metadata\) nor an HF folder"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            load(*argv)
    (tmp_path / "ckpt" / "step-4").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-4" / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"it holds the DCP steps \['step-4'\]: name one of them"):
        load("--checkpoint.initial_load_path", str(tmp_path / "ckpt"))
    assert load("--checkpoint.initial_load_path", str(tmp_path / "ckpt" / "step-4"))


def test_output_folders_must_be_creatable(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError, match=r"job.dump_folder = .*taken\" \(from the command line\): is a file; valid: "
                                          r"a folder, or a path where one can be created"):
        load("--job.dump_folder", str(tmp_path / "taken"))
    with pytest.raises(ConfigError, match=r"job.dump_folder = .*taken/run\" .*: cannot be created: '.*taken' is a file"):
        load("--job.dump_folder", str(tmp_path / "taken" / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_text("a file")
    with pytest.raises(ConfigError, match=r'checkpoint.folder = "checkpoint" \(the default\): is a file'):
        load("--job.dump_folder", str(tmp_path / "run"))
    assert load("--job.dump_folder", str(tmp_path / "new" / "run"))


def test_checkpoint_keys_that_need_checkpointing_are_not_silently_ignored():
    with pytest.raises(ConfigError, match=r"checkpoint.load_step = 5 \(from the command line\): nothing is resumed with "
                                          r"checkpoint.enable = false \(the default\); valid: -1, or checkpoint.enable"):
        load("--checkpoint.load_step", "5")
    with pytest.raises(ConfigError, match=r"checkpoint.last_save_in_hf = true .*: nothing is saved with checkpoint.enable"):
        load("--checkpoint.last_save_in_hf")
    assert load("--checkpoint.last_save_in_hf", "--checkpoint.enable", "--checkpoint.load_step", "5")


def test_recipe_name_falls_back_to_train_configs(tmp_path, monkeypatch):
    from titan_kimi.config.loader import REPO_RECIPES

    monkeypatch.chdir(tmp_path)
    cfg = load("--job.config_file", "k31_debug.toml")
    assert Path(cfg.job.config_file) == REPO_RECIPES / "k31_debug.toml"
    assert cfg.model.flavor == "k31_debug" and cfg.training.steps == 50
    (tmp_path / "train_configs").mkdir()
    (tmp_path / "train_configs" / "k31_debug.toml").write_text("[training]\nsteps = 3\n")
    assert load("--job.config_file", "k31_debug.toml").training.steps == 3  # the working folder's first
    (tmp_path / "k31_debug.toml").write_text("[training]\nsteps = 4\n")
    assert load("--job.config_file", "k31_debug.toml").training.steps == 4  # the path as given first of all
    with pytest.raises(ConfigError, match=r"no such file \(looked in nope.toml, train_configs/nope.toml, .*"
                                          r"train_configs/nope.toml\)"):
        load("--job.config_file", "nope.toml")
