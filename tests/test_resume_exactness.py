"""A stopped and resumed run is the run that was not stopped: 2 steps straight against 1 + resume + 1 from the
same folder, in one process, through every way a run ends and for each optimizer and precision setting that
ships. Every logged step (loss, grad norm, lr) and the whole end state (tests/resume_runs.py) are equal bit for
bit. The layouts (FSDP2, EP2, PP2, CP2) are tests/test_resume_layouts.py's."""

from __future__ import annotations

import pytest

from resume_runs import IMAGE_TEXT, SHIPPED, STEPS, Outcome, build, differences, run

RESUMABLE_EVERY_STEP = ("--checkpoint.enable", "true", "--checkpoint.interval", "1")
# A final save that is not also an interval save, and a stop by signal between interval saves.
FINAL_ONLY = ("--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only",
              "false")
SETTINGS = {
    # bf16 weights and bf16 moments (torch's foreach AdamW), two micro-batches per step.
    "bf16_foreach_accumulation": [*SHIPPED, "--model.dtype", "bfloat16", "--optimizer.state_dtype", "bfloat16",
                                  "--optimizer.implementation", "foreach", "--training.global_batch_size", "4"],
    # fp32 weights with bf16 moments (titan_kimi's MultiTensorAdam, CPU step counters), LoRA adapters with
    # dropout: the RNG stream matters.
    "mixed_dtype_adam_lora": [*SHIPPED, "--optimizer.state_dtype", "bfloat16", "--lora.enable", "true",
                              "--lora.dropout", "0.1"],
    # The image-text recipe (tower + projector trained), torch's for-loop AdamW.
    "image_text_for_loop": [*IMAGE_TEXT, "--optimizer.implementation", "for-loop"],
}


def extended(tmp_path, name: str, argv: list[str]) -> list[str]:
    """``training.steps`` raised on a finished run: 1 step (its final save), then the same folder to 2 steps,
    against 2 steps straight. The two schedules agree on step 1's lr only."""
    straight = run(build(tmp_path / f"{name}_straight", argv, "--training.steps", str(STEPS)))
    short = run(build(tmp_path / name, argv, *RESUMABLE_EVERY_STEP, "--training.steps", "1"))
    longer = build(tmp_path / name, argv, *RESUMABLE_EVERY_STEP, "--training.steps", str(STEPS))
    assert longer.step == 1
    return differences(straight, [short, run(longer)])


def test_every_way_a_run_ends_resumes_the_shipped_recipe_exactly(tmp_path):
    """The interval save (a run that dies after it), SIGTERM's save, and a final save extended to a longer run;
    the shipped recipe: fp32 master weights, bf16 compute, torch's fused AdamW."""
    straight = run(build(tmp_path / "straight", SHIPPED, *RESUMABLE_EVERY_STEP, "--training.steps", str(STEPS)))
    # Dies after the step-1 save: the straight run's own step-1 folder is what it left.
    after_interval = build(tmp_path / "straight", SHIPPED, *RESUMABLE_EVERY_STEP, "--training.steps", str(STEPS),
                           "--checkpoint.load_step", "1")
    assert after_interval.step == 1
    found = {"interval save": differences(straight, [Outcome(straight.logged[:1], {}), run(after_interval)])}

    stopped = run(build(tmp_path / "sigterm", SHIPPED, *FINAL_ONLY, "--training.steps", str(STEPS)), sigterm_at=1)
    assert stopped.logged[-1][0] == 1 and (tmp_path / "sigterm" / "checkpoint" / "step-1" / ".metadata").is_file()
    resumed = build(tmp_path / "sigterm", SHIPPED, *FINAL_ONLY, "--training.steps", str(STEPS))
    assert resumed.step == 1
    found["SIGTERM"] = differences(straight, [stopped, run(resumed)])

    short = run(build(tmp_path / "final", SHIPPED, *FINAL_ONLY, "--training.steps", "1"))
    longer = build(tmp_path / "final", SHIPPED, *FINAL_ONLY, "--training.steps", str(STEPS))
    assert longer.step == 1
    found["final save, extended"] = differences(straight, [short, run(longer)])
    assert found == {name: [] for name in found}


@pytest.mark.parametrize("name", SETTINGS)
def test_each_shipped_setting_resumes_exactly(tmp_path, name):
    assert extended(tmp_path, name, SETTINGS[name]) == []
