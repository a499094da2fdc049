#!/usr/bin/env bash
# Issue 15 on 2 x H200: k31_small under each 2-GPU layout against a one-GPU reference with the same global batch,
# 20 steps each, the last step profiled ([profiling]: NCCL share, CUDA busy, per-rank peak), in parts, each archived
# into $OUT/all.tgz as it ends so a call cut short still returns what finished.
#   usage (two device calls):  OUT=/tmp/out PARTS="refs fsdp ep" bash scripts/gpu_multi_validate.sh
#                              OUT=/tmp/out PARTS="pp cp tests" bash scripts/gpu_multi_validate.sh
#   (PARTS=tests alone again if the second call ran out of time)
#   PRIOR=DIR: an unpacked all.tgz of an earlier call (e.g. carried in an ignored folder of the tree); its runs are
#   copied in first (not overwriting), so this call's summary.md also compares with the references run there.
#   Or, here, unpack both all.tgz into one folder and: python3 scripts/summarize_layout_runs.py FOLDER/runs
# PARTS: refs (the four one-GPU references, two at a time on GPU 0 and GPU 1), fsdp (FSDP2, dp_shard 2), ep (FSDP2
#   + EP2), pp (PP2 1F1B; PP2 ZBVZeroBubble), cp (CP2 zigzag: FLA cp_context for KDA, latent gather for MLA/DSA),
#   tests (tests/test_multi_gpu.py: NCCL EP all-to-all, PP hand-off, CP KDA/MLA/DSA vs one GPU).
#
# What is compared with what. "8,192 tokens per GPU per step" (the issue) fixes the per-GPU work, so each 2-GPU
# layout's global batch is 16,384 tokens; a loss curve compares only with a one-GPU run of the same global batch
# (same sequences, same order: rank r of a data-parallel group reads samples r, r + 2, ... of the one order):
#   ref_b2      1 GPU, 2 x 8,192 tokens as 2 accumulation steps of 1    <- fsdp2, fsdp2_ep2, pp2_1f1b (2 microbatches)
#   ref_pp_s4k  1 GPU, k31_small_pp, 4 x 4,096 tokens                   <- pp2_zbv (4 stages of 4 layers need the
#               4-layer AttnRes blocks of k31_small_pp and >= 4 microbatches: 4 sequences of 4,096)
#   ref_s16k    1 GPU, 1 x 16,384 tokens                                <- cp2 (2 x 8,192 tokens of one sequence)
#   ref_b1      1 GPU, the recipe itself (1 x 8,192): the one-GPU speed at 8,192 tokens per GPU, no comparison
# With the recipe's bf16 weights, FSDP's bf16 parameter copies are the weights themselves: one GPU and FSDP share a
# precision policy (with fp32 master weights they would not; docs/parallelism.md).
# Eager (COMPILE=none) by default: the shipped reduce-overhead mode's CUDA graphs under NCCL and under the profiler
# are untried, and eager starts in seconds; COMPILE=reduce-overhead runs the recipe's mode. bf16 weights + moments as
# the recipe ships; tolerance: docs/perf.md's (step 1 within 2e-3 relative, mean |dloss| within 0.11 over 20 steps).
# NCCL variables (NCCL_NVLS_ENABLE and the like) are left as the machine sets them; env.txt records them.
# RECIPE and EXTRA (overrides after every run's own) exist for a CPU smoke test of the plumbing only, e.g.
#   RECIPE=train_configs/k31_debug.toml EXTRA="--training.seq_len 64 --lr_scheduler.warmup_steps 0" STEPS=2 PARTS=fsdp
set -u
PARTS=${PARTS:-refs fsdp ep}
COMPILE=${COMPILE:-none}
TRITON_AUTOTUNE=${TRITON_AUTOTUNE:-true}  # the recipe's; false = default configs, a faster first step of each run
STEPS=${STEPS:-20}
RUN_TIMEOUT=${RUN_TIMEOUT:-280}
RECIPE=${RECIPE:-train_configs/k31_small.toml}
read -r -a EXTRA <<< "${EXTRA:-}"
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-/tmp/gpu_multi_validate}
WORK=${WORK:-/tmp/gpu_multi_validate_work}  # runs live here: $OUT returns only a few files, two folders deep
mkdir -p "$OUT" "$WORK/runs"
if [ -n "${PRIOR:-}" ]; then cp -rn "$PRIOR/runs/." "$WORK/runs/" || exit 1; fi
if [ -d .whl ]; then  # the GPU machine has no network: wheels travel with the tree
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  env | grep -E '^(NCCL|CUDA_VISIBLE)' | sort
  git log --oneline -1 2>/dev/null; date -u; } > "$WORK/env.txt" 2>&1
cp "$WORK/env.txt" "$OUT/env.txt"; cat "$OUT/env.txt"
T0=$(date +%s)
step() {  # archive after every step; chrome traces travel apart (traces.tgz, size-capped)
  echo "[$1] rc=$2 at $(( $(date +%s) - T0 ))s"
  (cd "$WORK" && tar czf "$OUT/all.tgz.part" --exclude='*.trace.json.gz' . 2>/dev/null && mv "$OUT/all.tgz.part" "$OUT/all.tgz")
}

# name <TAB> reference <TAB> GPUs <TAB> what: written whole every call, so runs not made show as "not run".
printf '%s\n' \
  $'ref_b1\t-\t1\tthe recipe, 1 x 8,192' \
  $'ref_b2\t-\t1\t2 x 8,192, accumulation 2' \
  $'ref_pp_s4k\t-\t1\tk31_small_pp, 4 x 4,096' \
  $'ref_s16k\t-\t1\t1 x 16,384' \
  $'fsdp2\tref_b2\t2\tFSDP2 dp_shard 2, 1 x 8,192 per GPU' \
  $'fsdp2_ep2\tref_b2\t2\tFSDP2 + EP2, 1 x 8,192 per GPU' \
  $'pp2_1f1b\tref_b2\t2\tPP2 1F1B, 2 microbatches of 8,192, stages 12 + 4 layers' \
  $'pp2_zbv\tref_pp_s4k\t2\tPP2 ZBVZeroBubble, k31_small_pp, 4 microbatches of 4,096, 4 stages' \
  $'cp2\tref_s16k\t2\tCP2 zigzag, 2 x 8,192 tokens of one 16,384 sequence' \
  > "$WORK/runs/layouts.tsv"

COMMON=(--job.config_file "$RECIPE" --training.steps "$STEPS" --metrics.log_freq 1
        --compile.mode "$COMPILE" --kernels.triton_autotune "$TRITON_AUTOTUNE" --profiling.enable true --profiling.steps -1)
train() {  # $1 = name, $2 = GPUs, $3 = CUDA devices, rest = overrides of the recipe
  local name=$1 gpus=$2 devices=$3; shift 3
  rm -rf "$WORK/runs/$name"
  CUDA_VISIBLE_DEVICES=$devices timeout "$RUN_TIMEOUT" python3 -m torch.distributed.run --standalone \
    --nproc-per-node="$gpus" -m titan_kimi.train "${COMMON[@]}" --job.dump_folder "$WORK/runs/$name" "$@" "${EXTRA[@]}" \
    > "$WORK/runs/$name.log" 2>&1
  local rc=$?
  grep -E "profile step|summary:|Error|error:" "$WORK/runs/$name.log" | tail -5
  return $rc
}

if want refs; then  # two one-GPU runs side by side (the speed of each is then measured beside the other)
  train ref_b2 1 0 --training.global_batch_size 2 & a=$!
  train ref_s16k 1 1 --training.seq_len 16384 & b=$!
  wait $a; step ref_b2 $?; wait $b; step ref_s16k $?
  train ref_pp_s4k 1 0 --model.flavor k31_small_pp --training.seq_len 4096 --training.local_batch_size 4 & a=$!
  train ref_b1 1 1 & b=$!
  wait $a; step ref_pp_s4k $?; wait $b; step ref_b1 $?
fi
if want fsdp; then
  train fsdp2 2 0,1 --parallelism.data_parallel_shard_degree 2; step fsdp2 $?
fi
if want ep; then
  train fsdp2_ep2 2 0,1 --parallelism.expert_parallel_degree 2; step fsdp2_ep2 $?
fi
if want pp; then
  train pp2_1f1b 2 0,1 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \
    --training.local_batch_size 2; step pp2_1f1b $?
  train pp2_zbv 2 0,1 --model.flavor k31_small_pp --parallelism.pipeline_parallel_degree 2 \
    --parallelism.pipeline_parallel_schedule ZBVZeroBubble --training.seq_len 4096 --training.local_batch_size 4
  step pp2_zbv $?
fi
if want cp; then
  train cp2 2 0,1 --parallelism.context_parallel_degree 2 --parallelism.context_parallel_layout zigzag \
    --training.seq_len 16384; step cp2 $?
fi
if want tests; then
  timeout -s INT -k 20 300 python3 -m pytest -m gpu tests/test_multi_gpu.py -q -rs -rf --kernels-triton-autotune false \
    > "$WORK/pytest_multi_gpu.log" 2>&1
  step pytest_multi_gpu $?; tail -5 "$WORK/pytest_multi_gpu.log"
fi
python3 scripts/summarize_layout_runs.py "$WORK/runs" | tee "$WORK/summary.md" "$OUT/summary.md"
# Rank 0's trace of each run, newest first, while the archive stays under the 16 MiB a returned file may have.
(cd "$WORK" && ls -t runs/*/profiles/step-*/rank0.trace.json.gz 2>/dev/null | while read -r f; do
   tar rf traces.tar "$f"; [ "$(stat -c %s traces.tar)" -gt 15000000 ] && { tar --delete -f traces.tar "$f"; break; }
 done; [ -f traces.tar ] && mv traces.tar "$OUT/traces.tar")
step done 0
