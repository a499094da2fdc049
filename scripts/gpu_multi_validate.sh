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
#   tests (tests/test_multi_gpu.py: NCCL EP all-to-all, PP hand-off, CP KDA/MLA/DSA vs one GPU),
#   medium (k31_medium on a 4- or 8-GPU machine: PP x EP x FSDP and FSDP alone; skipped with fewer GPUs),
#   medium_ref (k31_medium's one-GPU references of 4 and 8 x 8,192 tokens; see "Part medium" below).
#   On nvidia-h200-x4, then nvidia-h200-x8, one call each:  OUT=/tmp/out PARTS=medium bash scripts/gpu_multi_validate.sh
#   and once, on any machine of 2 or more GPUs:             OUT=/tmp/out PARTS=medium_ref bash scripts/gpu_multi_validate.sh
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
  $'med_ref4\t-\t1\tk31_medium, full activation checkpointing, 4 x 8,192, accumulation 4' \
  $'med_ref8\t-\t1\tk31_medium, full activation checkpointing, 8 x 8,192, accumulation 8' \
  $'med4_fsdp4\tmed_ref4\t4\tk31_medium FSDP2 dp_shard 4, 1 x 8,192 per GPU, AC every 2nd block' \
  $'med4_pp2_ep2\tmed4_fsdp4\t4\tk31_medium PP2 1F1B x dp_shard 2 x EP2, 2 microbatches of 8,192, AC every 2nd block' \
  $'med4_pp2_ep2\tmed_ref4\t4\tthe same run against one GPU' \
  $'med8_fsdp8\tmed_ref8\t8\tk31_medium FSDP2 dp_shard 8, 1 x 8,192 per GPU, AC every 2nd block' \
  $'med8_pp2_ep4\tmed8_fsdp8\t8\tk31_medium PP2 1F1B x dp_shard 4 x EP4, 2 microbatches of 8,192, AC every 2nd block' \
  $'med8_pp2_ep4\tmed_ref8\t8\tthe same run against one GPU' \
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
# Part medium (issue 15: "k31_medium with PP x EP x FSDP at the largest degrees that fit"), one call per machine:
# the layout comes from the GPU count (NGPUS=N overrides nvidia-smi, for the CPU smoke test). k31_medium: 13.27B
# params (3.22B active), 24 layers in two 12-layer AttnRes blocks -> PP at most 2 (whole blocks per stage, no
# virtual stages), 96 routed experts -> EP divides 96 and dp_shard x cp (titan_kimi/parallel/layout.py). With PP2
# the rest is dp_shard = N/2, so EP = N/2 (EP2 at 4 GPUs, EP4 at 8; efsdp 1): the largest degrees there are.
# Per-rank memory from the project's dry run (on CPU, 2026-12-01: python3 -m titan_kimi.train --job.config_file
# train_configs/k31_small.toml --model.flavor k31_medium --job.dry_run true --job.estimate_activations true
# --job.world_size N + the layout's flags; bf16 weights + bf16 moments as the recipe ships, 8,192 tokens, no
# activation checkpointing unless said; communication buffers and allocator slack not counted):
#   1 GPU                       98.6 GiB params + grads + moments + 84.3 GiB activations + 0.25 GiB scores = 183 GiB:
#                               as shipped no one-GPU run fits 139 GiB;
#   1 GPU, activation_checkpoint full: 98.6 + 5.8 + 0.25 = 105 GiB: fits -> the one-GPU references (medium_ref)
#   4: pp2 x dp_shard 2 x ep2   pp rank 0: 23.9 + 1.5 in flight = 25.4 GiB, activations 42.0 GiB per microbatch
#                               (1F1B keeps 2 in flight on rank 0) -> about 25.4 + 2 x 42.0 + 0.25 = 110 GiB;
#                               pp rank 1: 25.4 + 1.5 = 26.9 GiB + 43.1 GiB (1 in flight) = 70.2 GiB
#   4: fsdp4                    24.6 + 1.9 in flight = 26.5 GiB + 84.3 GiB activations = 111 GiB
#      (fsdp4 + ep4 would be the same 111 GiB: EP moves expert weights, not activations)
#   8: pp2 x dp_shard 4 x ep4   pp rank 0: 11.9 + 1.3 = 13.2 GiB + 2 x 42.0 = 97.5 GiB; pp rank 1: 14.0 + 43.1 = 57.3
#   8: fsdp8                    12.3 + 1.9 = 14.2 GiB + 84.3 GiB = 98.7 GiB
# Those fit 139 GiB on paper with ~30 GiB to spare for what the estimate leaves out (NCCL buffers, FLA and indexer
# workspaces, fragmentation; on one H200 it came within +8% of k3_small and +6% of k31_small, docs/parallelism.md).
# A first multi-GPU run cannot afford an OOM, so both N-GPU layouts checkpoint
# every second block (MEDIUM_AC, default "selective 2": --activation_checkpoint.mode selective
# --activation_checkpoint.selective_ac_option 2; MEDIUM_AC=none runs them as estimated above):
#   4: fsdp4, selective 2       26.6 + 41.0 + 0.25 = 67.9 GiB estimated
#   4: pp2 x ep2, selective 2   pp rank 0: 25.4 + 2 x 21.6 + 0.25 = 68.9 GiB (rank 1: 48.9)
#   8: fsdp8, selective 2       14.2 + 41.0 + 0.25 = 55.5 GiB estimated
#   8: pp2 x ep4, selective 2   pp rank 0: 13.2 + 2 x 21.6 + 0.25 = 56.7 GiB (rank 1: 36.0)
#   1 GPU, full (medium_ref)    98.6 + 5.8 + 0.25 = 105 GiB estimated (the states are the bulk)
# Same global batch in every layout of one GPU count, N x 8,192 tokens (8,192 per GPU): FSDP reads 1 sequence per
# rank on N data-parallel ranks, PP2 2 microbatches of 1 sequence per rank on N/2, the one-GPU reference N
# accumulation steps of 1 -- the same N sequences per step (the loader's one shuffled order, rank r taking
# r, r + dp, ...). Loss references: on the N-GPU machine itself FSDP alone (the layout nearest one GPU), which
# PP x EP x FSDP is compared with -- two bf16 runs, so docs/perf.md's tolerance (meant for a run against one GPU)
# is applied to the difference of two runs that each carry bf16 noise; and, from a separate call (every GPU is
# busy during medium), the one-GPU runs med_ref4 / med_ref8 (PARTS=medium_ref, full activation checkpointing: it
# recomputes the same forward, so its losses are the uncheckpointed model's up to kernel nondeterminism; its speed
# pays the recompute and is no one-GPU speed to set beside the N-GPU ones), which both N-GPU layouts are compared with. medium_ref runs both side by side on GPUs 0 and 1 of any machine with 2 GPUs (one after the
# other with one GPU), each at most MEDIUM_REF_TIMEOUT seconds; a reference cut short compares over the steps it has.
# In medium the PP x EP run goes first (the one the issue asks for), each run at most MEDIUM_TIMEOUT seconds.
MED=(--model.flavor k31_medium --training.seq_len 8192)  # EXTRA (after these) may change both for a smoke test
if want medium; then
  NGPUS=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  MEDIUM_TIMEOUT=${MEDIUM_TIMEOUT:-270}
  if [ "$NGPUS" -ge 8 ]; then n=8; elif [ "$NGPUS" -ge 4 ]; then n=4; else n=0; fi
  if [ "$n" = 0 ]; then
    echo "[medium] skipped: $NGPUS GPU(s) here; the k31_medium part needs 4 or 8 (nvidia-h200-x4 / nvidia-h200-x8)"
  else
    devices=$(seq -s, 0 $((n - 1)))
    read -r mode option <<< "${MEDIUM_AC:-selective 2}"
    AC=(--activation_checkpoint.mode "$mode")
    [ -n "${option:-}" ] && AC+=(--activation_checkpoint.selective_ac_option "$option")
    RUN_TIMEOUT=$MEDIUM_TIMEOUT train "med${n}_pp2_ep$((n / 2))" "$n" "$devices" "${MED[@]}" "${AC[@]}" \
      --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \
      --parallelism.expert_parallel_degree $((n / 2)) --training.local_batch_size 2
    step "med${n}_pp2_ep$((n / 2))" $?
    RUN_TIMEOUT=$MEDIUM_TIMEOUT train "med${n}_fsdp${n}" "$n" "$devices" "${MED[@]}" "${AC[@]}" \
      --parallelism.data_parallel_shard_degree "$n" --training.local_batch_size 1
    step "med${n}_fsdp${n}" $?
  fi
fi
if want medium_ref; then
  NGPUS=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  MEDIUM_REF_TIMEOUT=${MEDIUM_REF_TIMEOUT:-540}
  REF=(--activation_checkpoint.mode full --training.local_batch_size 1)
  if [ "$NGPUS" -ge 2 ]; then
    RUN_TIMEOUT=$MEDIUM_REF_TIMEOUT train med_ref4 1 0 "${MED[@]}" "${REF[@]}" --training.global_batch_size 4 & a=$!
    RUN_TIMEOUT=$MEDIUM_REF_TIMEOUT train med_ref8 1 1 "${MED[@]}" "${REF[@]}" --training.global_batch_size 8 & b=$!
    wait $a; step med_ref4 $?; wait $b; step med_ref8 $?
  else
    RUN_TIMEOUT=$MEDIUM_REF_TIMEOUT train med_ref4 1 0 "${MED[@]}" "${REF[@]}" --training.global_batch_size 4
    step med_ref4 $?
    RUN_TIMEOUT=$MEDIUM_REF_TIMEOUT train med_ref8 1 0 "${MED[@]}" "${REF[@]}" --training.global_batch_size 8
    step med_ref8 $?
  fi
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
