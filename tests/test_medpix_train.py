"""The image-text recipes end to end on CPU: falling loss with and without LoRA, adapter files, FSDP2 + LoRA on
two processes against one, LoRA at PP2 against one process (adapters merged and exported, also by the pipelined
run's own final HF save), rows cut after their last real token (in one process, under FSDP x EP2 and under PP2;
the text recipe's HellaSwag rows under CP2), and the one-H200 recipe at reduced size.

The runs are one table (tests/train_runs.py), launched once per module: one launch per world size."""

import json

import pytest
import torch

from tests.train_runs import Run, TrainRuns

# Every test here reads the one module-scoped table: in one pytest-xdist worker (--dist loadgroup), each of its
# launches happens once per pytest run; spread over two workers, each worker would launch the table again.
pytestmark = pytest.mark.xdist_group("medpix_runs")

MEDPIX = ("--job.config_file", "train_configs/k31_medpix_debug.toml")
# fp32, 3 steps of global batch 4, in order: the LoRA layouts against one process
LORA_3_STEPS = (*MEDPIX, "--model.dtype", "float32", "--training.mixed_precision", "false", "--training.steps", "3",
                "--training.global_batch_size", "4", "--data.shuffle", "false", "--lr_scheduler.warmup_steps", "1",
                "--lora.enable", "true")
# Adam's eps at 1e-6: the adapters' first gradients (B starts at zero) hold elements near 1e-8, where the
# update g / (|g| + eps) turns fp32's summation-order rounding into 2e-3 of an lr-sized step; the compared
# adapters then differ by the layout's rounding alone
FSDP_LORA = (*LORA_3_STEPS, "--lora.target_modules", "attention,experts,projector,vision_tower",
             "--metrics.log_freq", "1", "--optimizer.eps", "1e-6")
# PP2 as users type it, in fp32, with validation, and the final save in HF (merged)
PIPELINED = (*MEDPIX, "--model.dtype", "float32", "--training.mixed_precision", "false", "--training.steps", "8",
             "--data.shuffle", "false", "--lora.enable", "true", "--lora.target_modules",
             "attention,experts,projector,vision_tower", "--metrics.log_freq", "1", "--validation.enable", "true",
             "--validation.freq", "4", "--validation.steps", "2")
EXPORT = ("--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true",
          "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "float32")
# fp32, 4 steps of 2 rows in order (the sample's rows hold 58-80 real tokens of 80), logged every step; the value
# of training.pad_to_multiple_of follows
TRIMMED = (*MEDPIX, "--model.dtype", "float32", "--training.mixed_precision", "false", "--training.steps", "4",
           "--training.local_batch_size", "2", "--data.shuffle", "false", "--metrics.log_freq", "1",
           "--training.pad_to_multiple_of")
# the text debug recipe on HellaSwag's padded rows (3 steps of 2 rows in order, fp32), cut to multiples of 8
TEXT_TRIMMED = ("--job.config_file", "train_configs/k3_debug.toml", "--data.dataset", "hellaswag", "--model.dtype",
                "float32", "--training.mixed_precision", "false", "--training.steps", "3", "--lr_scheduler.warmup_steps",
                "1", "--training.local_batch_size", "2", "--data.shuffle", "false", "--metrics.log_freq", "1",
                "--training.seq_len", "128", "--training.pad_to_multiple_of", "8")
EP2_MIXED = (*MEDPIX, "--training.steps", "4", "--training.local_batch_size", "2", "--data.shuffle", "false",
             "--metrics.log_freq", "1", "--parallelism.expert_parallel_degree", "2", "--training.pad_to_multiple_of")
RUNS = {
    # 1: under torchrun, as the recipe's users launch it; 12 of its 40 steps (the loss has fallen 29x by then)
    "debug": Run(1, (*MEDPIX, "--training.steps", "12")),
    "debug_lora": Run(1, (*MEDPIX, "--training.steps", "12", "--lora.enable", "true")),
    "fsdp_dp2": Run(2, (*FSDP_LORA, "--training.local_batch_size", "2")),
    "fsdp_single": Run(0, (*FSDP_LORA, "--training.local_batch_size", "4")),
    "ep_ep2": Run(2, (*LORA_3_STEPS, "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2")),
    "ep_single": Run(0, (*LORA_3_STEPS, "--training.local_batch_size", "4")),
    "pp_pp2": Run(2, (*PIPELINED, *EXPORT, "--parallelism.pipeline_parallel_degree", "2")),
    "pp_single": Run(0, (*PIPELINED, *EXPORT)),
    # the same 4 steps with every micro-batch at seq_len, and cut after its last real token
    "rows_whole": Run(0, (*TRIMMED, "0")),
    "rows_trimmed": Run(0, (*TRIMMED, "4")),
    # cut under CP2 (zigzag: 4 chunks of each trimmed row), against one process
    "text_rows_trimmed": Run(0, TEXT_TRIMMED),
    "cp2_text_rows_trimmed": Run(2, (*TEXT_TRIMMED, "--parallelism.context_parallel_degree", "2")),
    # cut under PP2: each new length gets its stages' static shapes
    "pp2_rows_trimmed": Run(2, (*TRIMMED, "4", "--parallelism.pipeline_parallel_degree", "2")),
    # two processes, FSDP x EP2, the recipe's mixed precision: whole rows, and cut (ranks cut to their own lengths)
    "ep2_rows_whole": Run(2, (*EP2_MIXED, "0")),
    "ep2_rows_trimmed": Run(2, (*EP2_MIXED, "4")),
    "vl_small": Run(0, ("--job.config_file", "train_configs/k31_vl_small.toml", "--model.flavor", "k31_debug",
                        "--model.vision_flavor", "moonvit3d_debug", "--training.steps", "6",
                        "--training.local_batch_size", "2", "--training.seq_len", "512", "--optimizer.implementation",
                        "for-loop")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return TrainRuns(tmp_path_factory.mktemp("medpix_runs"), RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_medpix_debug_recipe_trains_with_falling_loss(runs, lora):
    name = "debug_lora" if lora else "debug"
    out, metrics = runs.output(name), runs.rows(name)
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 12 and all(m["images"] == 8 for m in metrics)
    # measured at 12 steps: 8.13 -> 0.28 (3.4%) training everything, 8.13 -> 2.75 (34%) training the adapters
    assert losses[-1] < (0.5 if lora else 0.1) * losses[0], losses
    assert "summary: steps=12" in out
    adapters = runs.folder(name) / "lora_adapters"
    assert adapters.exists() == lora
    if lora:
        from titan_kimi.config import load_job_config
        from titan_kimi.data import TOKENIZER_DIR, KimiTokenizer
        from titan_kimi.lora import load_adapters, reset_adapters
        from titan_kimi.models.kimi_k3 import model_args_for
        from titan_kimi.training.setup.build import build_model_from_config

        config = json.loads((adapters / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 8
        cfg = load_job_config(["--job.config_file", "train_configs/k31_medpix_debug.toml", "--lora.enable", "true"],
                              environ={})
        model = build_model_from_config(cfg, model_args_for("k31_debug"), KimiTokenizer(TOKENIZER_DIR))
        model.to_empty(device="cpu")
        model.init_weights()
        reset_adapters(model)
        filled = load_adapters(model, adapters)  # the written files load back by name
        assert filled and any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.slow
def test_fsdp_with_lora_on_the_image_text_model_matches_one_process(runs):
    dp2, single = runs.losses("fsdp_dp2"), runs.losses("fsdp_single")
    assert len(dp2) == len(single) == 3
    assert dp2[0] == pytest.approx(single[0], rel=1e-5)
    for a, b in zip(dp2[1:], single[1:]):
        assert a == pytest.approx(b, rel=2e-3)
    # Both runs wrote the same adapters (rank 0 of the FSDP run gathers the shards).
    from safetensors.torch import load_file

    a = load_file(str(runs.folder("fsdp_dp2") / "lora_adapters" / "adapter_model.safetensors"))
    b = load_file(str(runs.folder("fsdp_single") / "lora_adapters" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("base_model.model.vision_tower.") for k in a)
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)


@pytest.mark.slow
def test_expert_parallel_lora_matches_one_process(runs):
    """Per-expert adapters shard with their experts (and stay trainable while the experts stay frozen)."""
    ep2, single = runs.losses("ep_ep2"), runs.losses("ep_single")
    assert ep2[0] == pytest.approx(single[0], rel=1e-5)
    for a, b in zip(ep2[1:], single[1:]):
        assert a == pytest.approx(b, rel=2e-3)
    from safetensors.torch import load_file

    a = load_file(str(runs.folder("ep_ep2") / "lora_adapters" / "adapter_model.safetensors"))
    b = load_file(str(runs.folder("ep_single") / "lora_adapters" / "adapter_model.safetensors"))
    expert_keys = [k for k in a if ".experts.7.w2." in k]
    assert a.keys() == b.keys() and expert_keys
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)


def worst_relative_difference(a: dict, b: dict) -> tuple[float, str]:
    """The largest per-tensor relative L2 difference of two state dicts with the same keys, and its key."""
    return max((float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)), k) for k in a)


@pytest.mark.slow
def test_pipelined_lora_trains_like_one_process_and_its_adapters_merge_and_export(runs, tmp_path):
    """PP2 as users type it, in fp32: falling loss, the losses and adapter files of one process, and the adapters
    load by name into a whole model and export merged like the one-process ones."""
    folders = {"pp2": runs.folder("pp_pp2"), "single": runs.folder("pp_single")}
    (pp2, pp2_val), (single, single_val) = (
        ([m for m in runs.rows(n) if "loss" in m], [m for m in runs.rows(n) if "validation_loss" in m])
        for n in ("pp_pp2", "pp_single"))
    assert [m["step"] for m in pp2_val] == [4, 8]
    assert pp2_val[0]["validation_tokens"] == single_val[0]["validation_tokens"]
    for a, b in zip(pp2_val, single_val):  # validation batches with images through the pipeline's eval
        assert a["validation_loss"] == pytest.approx(b["validation_loss"], rel=2e-3)
    assert len(pp2) == 8 and all(m["images"] == 8 for m in pp2)  # each image counted once, not per stage
    losses = [m["loss"] for m in pp2]
    assert losses[-1] < 0.7 * losses[0], losses
    assert losses[0] == pytest.approx(single[0]["loss"], rel=1e-5)
    for a, b in zip(pp2[1:], single[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)
    from safetensors.torch import load_file

    files = {name: folder / "lora_adapters" for name, folder in folders.items()}
    a, b = (load_file(str(files[n] / "adapter_model.safetensors")) for n in ("pp2", "single"))
    assert a.keys() == b.keys() and any(k.startswith("base_model.model.vision_tower.") for k in a)
    assert any(".layers.7." in k for k in a)  # the second stage's adapters are in the one file
    # per tensor, relative L2: 8 Adam steps on sums of another order (PP2's microbatches) drift by up to 2.0e-3 in
    # a routed expert's factor on some CPUs (fewest tokens, Adam's normalised step), elementwise further
    worst = worst_relative_difference(a, b)
    assert worst[0] < 5e-3, worst
    assert (files["pp2"] / "adapter_config.json").read_text() == (files["single"] / "adapter_config.json").read_text()

    # The pipelined run's own HF export (each stage's shards, one index): the one-process run's checkpoint.
    final = {name: folder / "checkpoint" / "hf-step-8" for name, folder in folders.items()}
    assert (final["pp2"] / "config.json").read_text() == (final["single"] / "config.json").read_text()
    ours, theirs = ({k: v for f in final[n].glob("*.safetensors") for k, v in load_file(str(f)).items()}
                    for n in ("pp2", "single"))
    assert ours.keys() == theirs.keys() and any(k.startswith("vision_tower.") for k in ours)
    assert not any("lora" in k for k in ours)
    worst = worst_relative_difference(ours, theirs)  # the merged weights carry the adapters' drift, diluted
    assert worst[0] < 1e-3, worst

    from titan_kimi.checkpoint import export_hf_checkpoint
    from titan_kimi.config import load_job_config
    from titan_kimi.data import TOKENIZER_DIR, KimiTokenizer
    from titan_kimi.lora import load_adapters, merged_tensors
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.training.setup.build import build_model_from_config
    from titan_kimi.training.setup.seeded_init import init_weights_seeded

    cfg = load_job_config(list(PIPELINED), environ={})
    exported = {}
    for name, folder in files.items():
        model = build_model_from_config(cfg, model_args_for("k31_debug"), KimiTokenizer(TOKENIZER_DIR))
        model.to_empty(device="cpu")
        init_weights_seeded(model, cfg.job.seed)  # the base weights both runs trained on
        assert load_adapters(model, folder)
        export_hf_checkpoint(model, tmp_path / f"hf_{name}", dtype=torch.float32, tensors=merged_tensors(model))
        exported[name] = {k: v for f in (tmp_path / f"hf_{name}").glob("*.safetensors")
                          for k, v in load_file(str(f)).items()}
    assert exported["pp2"].keys() == exported["single"].keys() and not any("lora" in k for k in exported["pp2"])
    worst = worst_relative_difference(exported["pp2"], exported["single"])
    assert worst[0] < 1e-3, worst


@pytest.mark.slow
def test_one_gpu_image_text_recipe_runs_at_reduced_size(runs):
    out, metrics = runs.output("vl_small"), runs.rows("vl_small")
    assert len(metrics) == 6 and all(m["images"] == 2 for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert "median_images_per_sec" in out


def test_trimmed_rows_train_as_the_whole_rows(runs):
    """``training.pad_to_multiple_of``: the columns after a batch's last real token never reach a real token, so
    cutting them changes no loss; the steps run and count fewer tokens."""
    whole, trimmed = runs.rows("rows_whole"), runs.rows("rows_trimmed")
    assert len(whole) == len(trimmed) == 4
    for a, b in zip(whole, trimmed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
        assert a["tokens"] == 2 * 80 and b["tokens"] % (2 * 4) == 0
    assert sum(b["tokens"] for b in trimmed) < sum(a["tokens"] for a in whole)


def test_trimmed_rows_train_under_pipeline_parallelism_as_in_one_process(runs):
    """Rows cut to a new length in each step (72, 76, 68, 76 tokens) through a PP2 pipeline, whose stages have
    static shapes: the runner builds each length's schedule, and the losses are the one process's (fp32)."""
    pp2, single = runs.rows("pp2_rows_trimmed"), runs.rows("rows_trimmed")
    assert len(pp2) == len(single) == 4
    assert [m["tokens"] for m in pp2] == [m["tokens"] for m in single]
    assert len({m["tokens"] for m in pp2}) > 1  # the length changed between steps
    assert pp2[0]["loss"] == pytest.approx(single[0]["loss"], rel=1e-5)
    for a, b in zip(pp2, single):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)


def test_trimmed_rows_train_under_context_parallelism_as_in_one_process(runs):
    """HellaSwag rows cut to 80 and 64 tokens, each split into CP2's zigzag chunks: the first step's loss and
    gradient norm are the one process's (fp32), the next steps within fp32's summation-order drift."""
    cp2, single = runs.rows("cp2_text_rows_trimmed"), runs.rows("text_rows_trimmed")
    assert len(cp2) == len(single) == 3
    assert [m["tokens"] for m in cp2] == [m["tokens"] for m in single]
    assert len({m["tokens"] for m in cp2}) > 1 and all(m["tokens"] < 2 * 128 for m in cp2)
    assert cp2[0]["loss"] == pytest.approx(single[0]["loss"], rel=1e-6)
    assert cp2[0]["grad_norm"] == pytest.approx(single[0]["grad_norm"], rel=1e-5)
    for a, b in zip(cp2[1:], single[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)


def test_trimmed_rows_train_as_the_whole_rows_under_fsdp_and_expert_parallelism(runs):
    """Two processes with the recipe's mixed precision: each rank cuts its own batch to its own length (the
    all-to-alls carry rows, not positions), and the losses stay within the bf16 layouts' tolerance of the whole
    rows' (step 1 within 2e-3, mean |dloss| <= 0.11: docs/perf.md, "Numerics of the compiled step")."""
    whole, trimmed = runs.rows("ep2_rows_whole"), runs.rows("ep2_rows_trimmed")
    assert len(whole) == len(trimmed) == 4
    assert trimmed[0]["loss"] == pytest.approx(whole[0]["loss"], rel=2e-3)
    assert sum(abs(a["loss"] - b["loss"]) for a, b in zip(whole, trimmed)) / 4 <= 0.11
    assert all(a["tokens"] == 2 * 2 * 80 for a in whole)
    assert sum(b["tokens"] for b in trimmed) < sum(a["tokens"] for a in whole)
