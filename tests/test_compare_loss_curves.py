"""scripts/check/loss_curves.py on synthetic ablate_compile results: the tolerance quantities per pair."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_loss_curves", ROOT / "scripts" / "check" / "loss_curves.py")
compare = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compare
spec.loader.exec_module(compare)


def write(folder: Path, runs: list[dict]) -> Path:
    folder.mkdir(parents=True)
    path = folder / "results.json"
    path.write_text(json.dumps({"setup": {}, "runs": runs}))
    return path


def test_pairs_give_mean_max_and_step_one_differences(tmp_path, capsys):
    a = write(tmp_path / "eager_a", [{"mode": "none", "losses": [10.0, 8.0, 6.0, 4.0]}])
    b = write(tmp_path / "flex", [{"mode": "reduce-overhead", "losses": [10.02, 8.5, 5.0, 4.0, 3.0]},
                                   {"mode": "default"}])  # a run without losses is skipped
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "pairs.json")]) == 0
    (row,) = json.loads((tmp_path / "pairs.json").read_text())
    assert row["a"] == "eager_a/none" and row["b"] == "flex/reduce-overhead" and row["steps"] == 4
    assert row["mean_abs_dloss"] == pytest.approx((0.02 + 0.5 + 1.0 + 0.0) / 4)
    assert row["max_abs_dloss"] == pytest.approx(1.0) and row["max_step"] == 3
    assert row["step1_rel_dloss"] == pytest.approx(0.02 / 10.02)
    assert "| eager_a/none | flex/reduce-overhead | 4 | 0.380 | 1.000 (3) |" in capsys.readouterr().out


def test_fewer_than_two_curves_is_an_error_naming_what_was_found(tmp_path):
    a = write(tmp_path / "only", [{"mode": "none", "losses": [1.0]}, {"mode": "default"}])
    with pytest.raises(ValueError, match=r"at least two runs with losses; found \['only/none'\]"):
        compare.main([str(a)])


def test_trainer_metrics_jsonl_gives_its_last_runs_losses(tmp_path):
    recipe = tmp_path / "k3_small_recipe"
    recipe.mkdir()
    records = [{"step": 1, "loss": 99.0}, {"step": 2, "loss": 98.0},  # an earlier run appended to the same file
               {"step": 1, "loss": 10.0}, {"step": 2, "validation_loss": 7.0, "validation_tokens": 5},
               {"step": 2, "loss": 9.0}, {"step": 2, "profile": []}]
    (recipe / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    eager = write(tmp_path / "eager", [{"mode": "none", "losses": [10.0, 8.0]}])
    curves = compare.load_curves([recipe / "metrics.jsonl", eager])
    assert curves == {"k3_small_recipe": [10.0, 9.0], "eager/none": [10.0, 8.0]}
    renamed = recipe / "fp32_metrics.jsonl"  # a copy kept beside others under another name
    renamed.write_text((recipe / "metrics.jsonl").read_text())
    assert compare.load_curves([renamed, eager])["k3_small_recipe/fp32_metrics"] == [10.0, 9.0]
