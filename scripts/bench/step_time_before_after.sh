#!/usr/bin/env bash
# Median step time of one short training run on an older source tree and on this one: BEFORE=DIR OUT_DIR=DIR [RECIPES="k3_small k31_small"] [STEPS=30] [WARMUP=5] [NPROC=1] [EXTRA="--parallelism.pipeline_parallel_degree 2"] bash scripts/bench/step_time_before_after.sh
# BEFORE: a source tree to compare against (e.g. `mkdir old && git archive HEAD~3 | tar -x -C old`). Each recipe
# of train_configs/ runs STEPS steps in each tree with a log line every step; the median step time of the steps
# after the first WARMUP, parsed from rank 0's log lines, goes to OUT_DIR/step_time.md and OUT_DIR/step_time.json.
# On CPU (a run shorter than the recipe's lr warm-up needs it shortened): BEFORE=old OUT_DIR=/tmp/st RECIPES=k3_debug
# STEPS=3 WARMUP=1 EXTRA="--lr_scheduler.warmup_steps 1" bash scripts/bench/step_time_before_after.sh
set -euo pipefail
AFTER=$(cd "$(dirname "$0")/../.." && pwd)
: "${BEFORE:?BEFORE=DIR: the older source tree to compare against}"
: "${OUT_DIR:?OUT_DIR=DIR: where the logs and the table go}"
BEFORE=$(cd "$BEFORE" && pwd)
RECIPES=${RECIPES:-"k3_small k31_small"}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
NPROC=${NPROC:-1}
EXTRA=${EXTRA:-}
PY=${PYTHON:-python3}
[[ "$STEPS" =~ ^[0-9]+$ && "$WARMUP" =~ ^[0-9]+$ && "$WARMUP" -lt "$STEPS" ]] ||
  { echo "STEPS=$STEPS and WARMUP=$WARMUP must be integers with WARMUP < STEPS" >&2; exit 2; }
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

for recipe in $RECIPES; do
  for side in before after; do
    tree=$BEFORE; [[ $side == after ]] && tree=$AFTER
    [[ -f "$tree/train_configs/$recipe.toml" ]] ||
      { echo "$tree/train_configs/$recipe.toml does not exist (RECIPES names files of train_configs/)" >&2; exit 2; }
    run="$OUT_DIR/$side/$recipe"
    rm -rf "$run" && mkdir -p "$run"
    echo "== $recipe, $side ($tree)" >&2
    # shellcheck disable=SC2086  # EXTRA is a list of arguments
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
      -m titan_kimi.train --job.config_file "train_configs/$recipe.toml" --training.steps "$STEPS" \
      --metrics.log_freq 1 --job.dump_folder "$run/dump" $EXTRA) >"$run/log.txt" 2>&1 ||
      { tail -n 30 "$run/log.txt" >&2; echo "the $side run of $recipe failed: $run/log.txt" >&2; exit 1; }
  done
done

"$PY" - "$OUT_DIR" "$WARMUP" "$STEPS" "$NPROC" "$EXTRA" "$BEFORE" "$AFTER" $RECIPES <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out, warmup, steps, nproc, extra, before, after, *recipes = sys.argv[1:]
# the trainer's per-step line: "[rank0] 12:00:00 step 7  loss 9.1234  grad_norm ... step 0.123s"
line = re.compile(r"^\[rank0\] \S+ step (\d+)  loss .* step ([0-9.]+)s")
rows = []
for recipe in recipes:
    row = {"recipe": recipe}
    for side in ("before", "after"):
        times = {int(m[1]): float(m[2]) for m in map(line.match, (Path(out) / side / recipe / "log.txt")
                 .read_text().splitlines()) if m}
        kept = [t for step, t in sorted(times.items()) if step > int(warmup)]
        if not kept:
            sys.exit(f"{out}/{side}/{recipe}/log.txt: no step lines after step {warmup}")
        row[f"{side}_median_s"], row[f"{side}_steps"] = statistics.median(kept), len(kept)
    row["after_over_before"] = row["after_median_s"] / row["before_median_s"]
    rows.append(row)
meta = {"before": before, "after": after, "steps": int(steps), "warmup": int(warmup), "nproc": int(nproc),
        "extra": extra}
(Path(out) / "step_time.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
table = [f"Median step time after {warmup} warm-up steps of {steps}, {nproc} process(es) {extra}".rstrip(), "",
         "| recipe | before (s) | after (s) | after / before |", "|---|---|---|---|"]
table += [f"| {r['recipe']} | {r['before_median_s']:.4f} | {r['after_median_s']:.4f} | "
          f"{r['after_over_before']:.3f} |" for r in rows]
(Path(out) / "step_time.md").write_text("\n".join(table) + "\n")
print("\n".join(table))
EOF
