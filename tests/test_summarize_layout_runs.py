"""scripts/gpu/summarize_layout_runs.py on synthetic metrics files: speed without the profiled step, the loss
comparison against the chosen reference, and runs that are missing."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("summarize_layout_runs", ROOT / "scripts" / "gpu" / "summarize_layout_runs.py")
summarize = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = summarize  # its dataclasses look their module up while being built
spec.loader.exec_module(summarize)


def write_run(folder: Path, name: str, losses: list[float], tps: float, profiled_tps: float = 1.0,
              shares: tuple[float, ...] = ()) -> None:
    run = folder / name
    run.mkdir(parents=True)
    rows = []
    for step, loss in enumerate(losses, 1):
        last = step == len(losses) and shares
        rows.append({"step": step, "loss": loss, "tokens_per_sec_per_device": profiled_tps if last else
                     (tps / 10 if step == 1 else tps), "mfu": 0.2, "peak_mem_gib": 40.0})
    if shares:
        rows.append({"step": len(losses), "profile": [
            {"rank": r, "step": len(losses), "comm_share": s, "peak_mem_gib": 50.0 + r} for r, s in enumerate(shares)]})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


REFERENCE = [12.5, 11.0, 9.0, 7.0, 5.0]
MANIFEST = "ref_b2\t-\t1\tone GPU, accumulation 2\nfsdp2\tref_b2\t2\tdp_shard 2\npp2\tref_b2\t2\t1F1B\n" \
           "cp2\tref_s16k\t2\tzigzag\n"


def test_table_compares_each_layout_with_its_reference(tmp_path, capsys):
    write_run(tmp_path, "ref_b2", REFERENCE, 20000.0)
    write_run(tmp_path, "fsdp2", [12.51, 11.1, 9.05, 7.0, 5.1], 18000.0, shares=(0.10, 0.30))
    write_run(tmp_path, "pp2", [12.9, 11.0, 9.0, 7.0, 5.0], 15000.0)  # step 1 off by 3.2%
    write_run(tmp_path, "cp2", [12.0, 11.0], 9000.0)  # its reference (ref_s16k) was not run
    (tmp_path / "layouts.tsv").write_text(MANIFEST)
    assert summarize.main([str(tmp_path)]) == 0
    rows = {line.split(" | ")[0].strip("| ").split(" (")[0]: line.split(" | ") for line in
            capsys.readouterr().out.splitlines() if line.startswith("| ") and not line.startswith("| layout")}
    assert rows["ref_b2"][3] == "20,000" and rows["ref_b2"][4] == "20.0%"
    fsdp = rows["fsdp2"]
    assert fsdp[3] == "18,000"  # the profiled last step (1 tok/s) and the first step are left out
    assert fsdp[5] == "51.0" and fsdp[6] == "20.0% (30.0%)"
    assert fsdp[7] == "5" and fsdp[8] == "8.0e-04" and fsdp[9] == "0.100" and fsdp[10] == "0.052"
    assert fsdp[11].startswith("yes")
    assert rows["pp2"][11].startswith("**no**")  # step 1 beyond 2e-3 relative
    assert "reference ref_s16k not run" in rows["cp2"][8]


def test_a_run_that_did_not_happen_is_a_row_saying_so(tmp_path):
    write_run(tmp_path, "ref_b2", REFERENCE, 20000.0)
    text = summarize.table(tmp_path, _manifest(tmp_path))
    assert "| fsdp2 (dp_shard 2) | 2 | ref_b2 | not run (no metrics.jsonl) |" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 5  # header + 4 runs


def _manifest(folder: Path):
    (folder / "layouts.tsv").write_text(MANIFEST)
    return summarize.read_manifest(folder / "layouts.tsv")


def test_bad_manifest_line_is_rejected(tmp_path):
    (tmp_path / "layouts.tsv").write_text("fsdp2 ref_b2 2 spaces-not-tabs\n")
    with pytest.raises(ValueError, match=r"layouts.tsv:1: .*valid: name<TAB>reference\|-<TAB>gpus<TAB>what"):
        summarize.read_manifest(tmp_path / "layouts.tsv")


def test_a_run_compared_with_a_multi_gpu_run_and_with_one_gpu(tmp_path, capsys):
    """k31_medium's PP x EP x FSDP run has two lines: against FSDP on its machine, and against the one-GPU run."""
    write_run(tmp_path, "med_ref4", REFERENCE, 5000.0)
    write_run(tmp_path, "med4_fsdp4", [12.5, 11.02, 9.0, 7.0, 5.0], 6000.0, shares=(0.2, 0.2, 0.2, 0.2))
    write_run(tmp_path, "med4_pp2_ep2", [12.5, 11.0, 9.3, 7.0, 5.0], 4000.0, shares=(0.3, 0.3, 0.4, 0.4))
    (tmp_path / "layouts.tsv").write_text(
        "med_ref4\t-\t1\tone GPU\nmed4_fsdp4\tmed_ref4\t4\tfsdp4\nmed4_pp2_ep2\tmed4_fsdp4\t4\tpp2 x ep2\n"
        "med4_pp2_ep2\tmed_ref4\t4\tthe same run against one GPU\n")
    assert summarize.main([str(tmp_path)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| med4_pp2_ep2")]
    assert [r[2] for r in rows] == ["med4_fsdp4", "med_ref4"]
    assert all(r[3] == "4,000" and r[6] == "35.0% (40.0%)" for r in rows)  # one run, its numbers on both lines
    assert rows[0][9] == "0.300" and rows[0][10] == "0.064"  # vs FSDP: |0, 0.02, 0.3, 0, 0| -> mean 0.064
    assert rows[1][9] == "0.300" and rows[1][10] == "0.060"  # vs one GPU: |0, 0, 0.3, 0, 0|
