#!/usr/bin/env bash
# One-H200 speed measurements (issue 17) in parts, each archived into $OUT/all.tgz as it ends, so a call cut short
# still returns what finished. "before" runs the tree unpacked in .before/ (`git archive <commit>`), "after" this one.
#   usage: OUT=/tmp/out PARTS="tests ops" bash scripts/gpu_measure_speed.sh
#   RECIPE_EXTRA: overrides appended to every recipe run (e.g. "--compile.granularity module"); RECIPE_TIMEOUT (s);
#   TESTS_TIMEOUT (s, per test file) and TEST_FILES (a subset) for the tests part;
#   KDA_SHAPES / KDA_LAYOUTS: bench_kda.py's --shapes / --layouts (default "k3_small k3" /
#   "docs_padded one_doc_padded")
# PARTS: tests (GPU tests of the new backends), ops (per-op benchmarks: linear CE, optimizer step), cp_model (the
#   whole-model context-parallel GPU tests, slow: FLA tunes fp32 shapes), before (k3_small compiled, fp32 master
#   weights, + profile), after (the bf16 setting eager, and the fp32 one as before, + profiles), recipes (the shipped
#   k3_small and k31_small recipes from an empty Inductor cache: time from launch to the first step), recipes_prewarm
#   (the same with compile.prewarm_modules), k3_small_prewarm (only its k3_small run), varlen
#   (kernels.causal_attention = varlen: GPU tests, bench_causal_attention.py, the k3_small recipe), varlen_more (varlen
#   in k31_small and in fp32-master k3_small, and k3_small twice over one compile.cache_dir), recipe_spread
#   (two eager runs of the k3_small recipe compared with it as shipped), eager_variant (the k3_small recipe eager with
#   kernels.causal_attention = sdpa: how far an exact kernel change moves the loss curve), recipes_fp32 (both recipes with fp32 master
#   weights, from empty caches), flex_tests
#   (kernels.causal_attention = flex against fp32 SDPA at k3_small's MLA shape), flex_ops (sdpa vs flex per-op
#   benchmark), before_bf16 / after_bf16 / flex_step (the k3_small bf16 step under reduce-overhead: .before tree,
#   this tree, this tree with kernels.causal_attention = flex; + profiles), kda_tests / kda_graph_test (the fla KDA
#   op's GPU tests / only its CUDA-graph replay), kda_capture (scripts/repro_kda_cudagraph_capture.py: toy KDA blocks under reduce-overhead, gradients against eager), par_tests
#   (GPU test files side by side), spread (two eager bf16 runs and the reduce-overhead one, loss curves compared
#   pairwise by scripts/compare_loss_curves.py), cudnn_kda (kernels.kda = cudnn, cuDNN-FE 1.32's Hopper engine: its GPU tests
#   against the reference and fla unless par_tests ran them, then scripts/bench_kda.py, fla vs cudnn), cudnn_kda_bench
#   (only the benchmark), cudnn_kda_grads (scripts/check_cudnn_kda_gradients.py: cuDNN's raw KDA gradients
#   against the fp32 reference), cudnn_dsa_indexer (scripts/bench_cudnn_dsa_indexer.py: cuDNN's sm90 indexer
#   score + top-k against ours; needs the CuTe-DSL wheels, the big one sent ahead through scripts/wheel_parts.sh),
#   cudnn_indexer (kernels.indexer_topk = cudnn: its GPU tests, the same benchmark, the k31_small recipe with it),
#   cudnn_dsa (both cuDNN DSA backends, indexer_topk = cudnn in its THD layout and sparse_mla = cudnn: their GPU
#   tests, scripts/bench_sparse_mla_backward.py and the indexer benchmark), recipe_cudnn_dsa (k31_small from empty
#   caches with both), cudnn_dsa_tests (cudnn_dsa's GPU tests alone), import_profile (python -X importtime of the trainer's imports, and of FLA's KDA modules),
#   flash_mla_build (scripts/build_flash_mla.sh from the carried .src/flash_mla_src.tar.xz into /tmp/flash_site, in
#   the background: it outlives the call while the machine stays warm), flash_mla (waits for that build, then
#   kernels.sparse_mla = flash_mla's GPU tests and scripts/bench_sparse_mla_forward.py), numerics
#   (scripts/check_compile_numerics.py: the compiled k3_small step against eager on the same weights, bf16 with
#   the sdpa variant and fp32 master weights against the fp32 truth; numerics_fp32 the latter alone), vl_recipe (the
#   image-text k31_vl_small recipe as shipped, then under default, with fp32 master weights, and eager fp32);
#   vl_recipe_shipped (only the first of those), vl_lora (the shipped image-text recipe with --lora.enable true),
#   recipes_no_fla_prewarm (k3_small with --kernels.prewarm_fla false);
#   NUMERICS_STEPS / NUMERICS_TIMEOUT / NUMERICS_FP32_EXTRA / NUMERICS_FP32_VARIANT shape the numerics_fp32 part
set -u
PARTS=${PARTS:-tests ops}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-/tmp/gpu_measure_speed}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the GPU machine has no network: wheels travel with the tree
  # CUDA header wheels (for cuDNN-FE's NVRTC kernels) go outside PYTHONPATH, so torch keeps loading its own
  # CUDA runtime; the cuDNN frontend finds the headers through CUDAToolkit_ROOT.
  # bytecode compiled at install, as a user's pip install does (first imports on a fresh machine then compile
  # nothing; earlier sessions installed with --no-compile and paid that in every run's start-up)
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/nvidia_cuda_')
  ls .whl/nvidia_cuda_*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
    --upgrade --target /tmp/cuda_headers .whl/nvidia_cuda_*.whl
fi
for parts in .whl_parts/*/; do  # wheels over one call's 64 MiB arrive a part per call (scripts/wheel_parts.sh)
  [ -f "$parts/MANIFEST" ] && bash scripts/wheel_parts.sh collect "$(basename "$parts")" /tmp/site
done
[ -d /tmp/cuda_headers/nvidia/cu13 ] && export CUDAToolkit_ROOT=/tmp/cuda_headers/nvidia/cu13
[ -d /tmp/flash_site/flash_mla ] && export PYTHONPATH=${PYTHONPATH:-}:/tmp/flash_site  # an earlier call's build
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import cudnn; print('cudnn frontend', cudnn.__version__, 'backend', cudnn.backend_version())" || true
  python3 -c "import flash_mla; print('flash_mla present')" || true
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
T0=$(date +%s)
step() {
  echo "[$1] rc=$2 at $(( $(date +%s) - T0 ))s"
  (cd "$OUT" && tar czf all.tgz.part --exclude=all.tgz --exclude=all.tgz.part . 2>/dev/null && mv all.tgz.part all.tgz)
}
K3_SMALL=(--flavor k3_small --config train_configs/k31_small.toml --seq-len 8192 --batch 1 --steps 20
          --lr-warmup-steps 5 --cache warm --no-plot)
BF16=(--model.dtype bfloat16 --optimizer.state_dtype bfloat16)
FP32=(--model.dtype float32 --optimizer.state_dtype float32)  # fp32 master weights, bf16 compute (autocast)
ablate() {  # $1 = tree, $2 = name, $3 = modes, rest = ablate_compile.py options then "--" overrides
  local tree=$1 name=$2 modes=$3; shift 3
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 scripts/ablate_compile.py "${K3_SMALL[@]}" \
    --modes "$modes" --profile --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1)
  step "$name" $?; cat "$OUT/$name/results.md" 2>/dev/null | tail -4
}
recipe() {  # $1 = recipe, $2 = name, $3 = cache (cold: empty Inductor/Triton caches; or a shared cache's name),
  # rest = overrides. Launch -> first step from the log's clock; the trainer's own compile report follows.
  local config=$1 name=$2 cache=$3 t=$(date +%s); shift 3
  [ "$cache" = cold ] && { cache=$name; rm -rf "/tmp/inductor_$cache" "/tmp/triton_$cache" "/tmp/$name"; }
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_$cache TRITON_CACHE_DIR=/tmp/triton_$cache TORCH_LOGS=recompiles \
    timeout "${RECIPE_TIMEOUT:-280}" python3 -m torch.distributed.run --nproc-per-node=1 -m titan_kimi.train \
    --job.config_file "$config" --training.steps 20 --metrics.log_freq 1 --job.dump_folder "/tmp/$name" "$@" \
    ${RECIPE_EXTRA:-} > "$OUT/$name.log" 2>&1
  step "$name" $?
  mkdir -p "$OUT/$name" && cp "/tmp/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  python3 - "$OUT/$name.log" "$t" <<'EOF'
import datetime, re, sys
log, launched = sys.argv[1], int(sys.argv[2])
for line in open(log):
    m = re.match(r"\[rank0\] (\d\d):(\d\d):(\d\d) step 1 ", line)
    if m:
        start = datetime.datetime.fromtimestamp(launched, datetime.timezone.utc)
        first = start.replace(hour=int(m[1]), minute=int(m[2]), second=int(m[3]))
        print(f"launch -> first step finished: {(first - start).total_seconds():.0f} s")
EOF
  grep -E "took|summary|Error" "$OUT/$name.log" | cut -c1-400 | tail -6
}

if want tests; then
  tests=(tests/test_moe_gpu.py tests/test_linear_cross_entropy_gpu.py tests/test_optimizer.py
         tests/test_dsa_dense_shortcut_gpu.py tests/test_triton_kernels.py tests/test_vision_lora_gpu.py
         tests/test_kernel_prewarm_gpu.py)
  [ -n "${TEST_FILES:-}" ] && read -r -a tests <<< "$TEST_FILES"  # a subset (e.g. the rest of a cut-off run)
  # one pytest per file, each with its own limit and log: a slow file costs its own time only, and the logs
  # say how long each took (earlier calls lost whole runs to one shared limit)
  for t in "${tests[@]}"; do
    name=$(basename "$t" .py); started=$(date +%s)
    timeout -s INT -k 20 "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu --kernels-triton-autotune false "$t" \
      -v -rs -rf --durations=5 > "$OUT/pytest_$name.log" 2>&1
    rc=$?; step "pytest $name ($(( $(date +%s) - started )) s)" $rc; tail -2 "$OUT/pytest_$name.log"
  done
fi
if want kda_tests; then  # the fla KDA backend: reference parity, compiled, and CUDA-graph replay across layouts
  timeout -s INT -k 20 150 python3 -m pytest -m gpu tests/test_kda_gpu.py -q -rs -rf > "$OUT/pytest_kda_gpu.log" 2>&1
  step pytest_kda $?; tail -4 "$OUT/pytest_kda_gpu.log"
fi
if want kda_graph_test; then  # only the CUDA-graph replay of the fla KDA op across document layouts
  timeout -s INT -k 20 200 python3 -m pytest -m gpu tests/test_kda_gpu.py -q -rs -rf -k cuda_graph \
    > "$OUT/pytest_kda_graph_gpu.log" 2>&1
  step pytest_kda_graph $?; tail -4 "$OUT/pytest_kda_graph_gpu.log"
fi
if want kda_capture; then  # an untagged copy of the fla KDA op captured under reduce-overhead, against eager
  rm -rf /tmp/inductor_kda_capture
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_kda_capture timeout 200 python3 scripts/repro_kda_cudagraph_capture.py \
    > "$OUT/repro_kda_cudagraph_capture.log" 2>&1
  step kda_capture $?; tail -30 "$OUT/repro_kda_cudagraph_capture.log"
fi
if want ops; then
  [ -f scripts/bench_linear_cross_entropy.py ] && { timeout 200 python3 scripts/bench_linear_cross_entropy.py \
    --out "$OUT/bench_linear_cross_entropy.json" > "$OUT/bench_linear_cross_entropy.md" 2>&1
    step bench_ce $?; tail -12 "$OUT/bench_linear_cross_entropy.md"; }
  [ -f scripts/bench_optimizer_step.py ] && { timeout 150 python3 scripts/bench_optimizer_step.py \
    --out "$OUT/bench_optimizer_step.json" > "$OUT/bench_optimizer_step.md" 2>&1
    step bench_optimizer $?; tail -10 "$OUT/bench_optimizer_step.md"; }
fi
if want cp_model; then
  timeout -s INT -k 20 220 python3 -m pytest -m gpu tests/test_context_parallel_gpu.py -q -rs -rf -k model \
    > "$OUT/pytest_cp_model_gpu.log" 2>&1
  step pytest_cp_model $?; tail -3 "$OUT/pytest_cp_model_gpu.log"
fi
if want flex_tests; then
  timeout -s INT -k 20 420 python3 -m pytest -m gpu tests/test_flex_attention_gpu.py -q -rs -rf > "$OUT/pytest_flex_gpu.log" 2>&1
  step pytest_flex $?; tail -4 "$OUT/pytest_flex_gpu.log"
fi
if want flex_ops; then
  timeout 130 python3 scripts/bench_causal_attention.py --out "$OUT/bench_causal_attention.json" \
    > "$OUT/bench_causal_attention.md" 2>&1
  step bench_causal_attention $?; tail -12 "$OUT/bench_causal_attention.md"
fi
if want before; then
  ablate .before before_fp32 default
fi
if want before_bf16; then  # the shipped setting (bf16 weights + moments, reduce-overhead) on the .before tree
  ablate .before before_bf16 reduce-overhead -- "${BF16[@]}"
fi
if want after_bf16; then
  ablate . after_bf16 reduce-overhead -- "${BF16[@]}"
fi
if want flex_step; then  # the same with kernels.causal_attention = flex
  ablate . flex_bf16 reduce-overhead -- "${BF16[@]}" --kernels.causal_attention flex
fi
if want spread; then  # bf16 weights' run-to-run spread: two eager runs, then the shipped mode, compared pairwise
  ablate . eager_bf16_a none -- "${BF16[@]}"
  ablate . eager_bf16_b none -- "${BF16[@]}"
  [ -f "$OUT/flex_bf16/results.json" ] || ablate . flex_bf16 reduce-overhead -- "${BF16[@]}"
  python3 scripts/compare_loss_curves.py "$OUT"/{eager_bf16_a,eager_bf16_b,flex_bf16}/results.json \
    --out "$OUT/loss_spread.json" > "$OUT/loss_spread.md" 2>&1
  step spread $?; cat "$OUT/loss_spread.md"
fi
if want after; then
  ablate . after_bf16_eager none -- "${BF16[@]}"
  ablate . after_fp32 default -- "${FP32[@]}"
fi
if want recipes; then
  recipe train_configs/k3_small.toml k3_small_recipe cold
  recipe train_configs/k31_small.toml k31_small_recipe cold
fi
if want recipes_no_fla_prewarm; then  # kernels.prewarm_fla = false: what the FLA prewarm processes save
  recipe train_configs/k3_small.toml k3_small_recipe_no_fla_prewarm cold --kernels.prewarm_fla false
fi
if want recipes_prewarm || want k3_small_prewarm; then  # compile.prewarm_modules (module kinds side by side)
  recipe train_configs/k3_small.toml k3_small_recipe_prewarm cold --compile.prewarm_modules true
  want recipes_prewarm && recipe train_configs/k31_small.toml k31_small_recipe_prewarm cold --compile.prewarm_modules true
fi
if want varlen; then  # kernels.causal_attention = varlen: its GPU tests, sdpa/flex/varlen per op, k3_small cold
  timeout -s INT -k 20 300 python3 -m pytest -m gpu tests/test_varlen_attention_gpu.py -q -rs -rf \
    > "$OUT/pytest_varlen_gpu.log" 2>&1
  step pytest_varlen $?; tail -4 "$OUT/pytest_varlen_gpu.log"
  timeout 200 python3 scripts/bench_causal_attention.py --docs 100 1000 4000 --out "$OUT/bench_causal_attention.json" \
    > "$OUT/bench_causal_attention.md" 2>&1
  step bench_causal_attention $?; tail -8 "$OUT/bench_causal_attention.md"
  recipe train_configs/k3_small.toml k3_small_recipe_varlen cold --kernels.causal_attention varlen
fi
if want varlen_more; then  # varlen in k31_small, the fp32-master k3_small, and a compile.cache_dir restart
  recipe train_configs/k31_small.toml k31_small_recipe_varlen cold --kernels.causal_attention varlen
  recipe train_configs/k3_small.toml k3_small_recipe_varlen_fp32 cold --kernels.causal_attention varlen "${FP32[@]}"
  rm -rf /tmp/k3_small_compile_cache
  for run in first restart; do  # the second process finds the first one's kernels in compile.cache_dir
    recipe train_configs/k3_small.toml k3_small_varlen_cache_$run cold --kernels.causal_attention varlen \
      --compile.cache_dir /tmp/k3_small_compile_cache
  done
fi
if want recipe_spread; then  # two eager runs of the k3_small recipe against it as shipped: the loss tolerance
  recipe train_configs/k3_small.toml k3_small_eager_a eager --compile.mode none
  recipe train_configs/k3_small.toml k3_small_eager_b eager --compile.mode none
  python3 scripts/compare_loss_curves.py "$OUT"/{k3_small_eager_a,k3_small_eager_b,k3_small_recipe}/metrics.jsonl \
    --out "$OUT/recipe_loss_spread.json" > "$OUT/recipe_loss_spread.md" 2>&1
  step recipe_spread $?; cat "$OUT/recipe_loss_spread.md"
fi
if want eager_variant; then  # eager with another exact attention kernel (sdpa): a rounding-level perturbation's spread
  recipe train_configs/k3_small.toml k3_small_eager_sdpa eager --compile.mode none --kernels.causal_attention sdpa
fi
if want recipes_fp32; then  # the fp32-master setting of both recipes (bf16 compute), from empty caches
  recipe train_configs/k3_small.toml k3_small_recipe_fp32 cold "${FP32[@]}"
  recipe train_configs/k31_small.toml k31_small_recipe_fp32 cold "${FP32[@]}"
fi
if want cudnn_kda || want par_tests || want cudnn_kda_bench; then
  export CUDNN_FRONTEND_CAKE_CACHE_DIR=${CUDNN_FRONTEND_CAKE_CACHE_DIR:-/tmp/cudnn_cake_cache}  # NVRTC cubins
  python3 -c "from lowerings.ops.kda import BACKENDS; print('kernels.kda = cudnn:', BACKENDS.checks['cudnn']() or 'available')" \
    > "$OUT/cudnn_kda_available.txt" 2>&1; cat "$OUT/cudnn_kda_available.txt"
fi
if want par_tests; then  # GPU test files side by side (compile-bound: the CPU cores do most of the work)
  for t in kda_gpu kda_cudnn_gpu flex_attention_gpu; do
    timeout -s INT -k 20 260 python3 -m pytest -m gpu tests/test_$t.py -q -rs -rf > "$OUT/pytest_$t.log" 2>&1 &
  done
  wait; step par_tests 0
  for t in kda_gpu kda_cudnn_gpu flex_attention_gpu; do echo "== $t"; tail -4 "$OUT/pytest_$t.log"; done
fi
if want cudnn_kda; then  # kernels.kda = cudnn: parity with the reference and fla, compiled, graph replay; then speed
  want par_tests || { timeout -s INT -k 20 240 python3 -m pytest -m gpu tests/test_kda_cudnn_gpu.py -q -rs -rf \
    > "$OUT/pytest_kda_cudnn_gpu.log" 2>&1; step pytest_kda_cudnn $?; tail -4 "$OUT/pytest_kda_cudnn_gpu.log"; }
fi
cute_dsl() {  # the CuTe-DSL runtime for cuDNN's DSA kernels: nvidia-cutlass-dsl, -libs-base, -libs-core and
  # apache-tvm-ffi in .whl_cute (unpacked only for the parts that use them, so no other part sees a half runtime),
  # -libs-cu13 (92 MB) through .whl_parts; its .pth (not read under --target) puts dsl_packages on the path.
  # Unzipped, not pip-installed: pip --target --upgrade would replace the nvidia_cutlass_dsl folder that
  # libs-cu13's parts were unpacked into; the wheels' files are disjoint and merge
  for w in .whl_cute/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done
  export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
  python3 -c "import cutlass.cute; from cudnn.deepseek_sparse_attention import indexer_forward_wrapper; print('CuTe DSL and cuDNN DSA import')" \
    > "$OUT/cudnn_dsa_import.txt" 2>&1; tail -3 "$OUT/cudnn_dsa_import.txt"
}
if want cudnn_dsa_indexer || want cudnn_indexer || want cudnn_dsa || want recipe_cudnn_dsa || want cudnn_dsa_tests; then
  cute_dsl
fi
if want cudnn_dsa || want cudnn_dsa_tests; then  # both cuDNN DSA backends: GPU tests, then (cudnn_dsa) the benchmark
  for t in sparse_mla_cudnn_gpu indexer_topk_cudnn_gpu; do
    timeout -s INT -k 20 300 python3 -m pytest -m gpu --kernels-triton-autotune false tests/test_$t.py -v -rs -rf \
      > "$OUT/pytest_$t.log" 2>&1
    step "pytest $t" $?; tail -12 "$OUT/pytest_$t.log"
  done
fi
if want cudnn_dsa; then
  timeout 300 python3 scripts/bench_sparse_mla_backward.py --out "$OUT/bench_sparse_mla_backward.json" \
    > "$OUT/bench_sparse_mla_backward.md" 2>&1
  step bench_sparse_mla_backward $?; tail -8 "$OUT/bench_sparse_mla_backward.md"
fi
if want recipe_cudnn_dsa; then  # k31_small with both cuDNN DSA backends, from empty caches
  recipe train_configs/k31_small.toml k31_small_recipe_cudnn_dsa cold --kernels.indexer_topk cudnn \
    --kernels.sparse_mla cudnn
fi
if want flash_mla_build; then  # FlashMLA's two sm90 sparse kernels (~1-2 min on 16 cores), beside the other parts
  rm -f /tmp/flash_build.rc
  setsid nohup bash -c "MAX_JOBS=8 bash scripts/build_flash_mla.sh build .src/flash_mla_src.tar.xz /tmp/flash_site \
    > /tmp/flash_build.log 2>&1; echo \$? > /tmp/flash_build.rc" < /dev/null > /dev/null 2>&1 &
  echo "flash_mla build started in the background (/tmp/flash_build.log)"
fi
if want flash_mla; then
  for _ in $(seq 1 60); do [ -f /tmp/flash_build.rc ] && break; sleep 5; done
  cp /tmp/flash_build.log "$OUT/flash_build.log" 2>/dev/null; echo "flash_mla build rc=$(cat /tmp/flash_build.rc 2>&1)"
  tail -5 /tmp/flash_build.log
  export PYTHONPATH=$PYTHONPATH:/tmp/flash_site
  timeout -s INT -k 20 300 python3 -m pytest -m gpu --kernels-triton-autotune false tests/test_sparse_mla_flash_mla_gpu.py \
    -v -rs -rf > "$OUT/pytest_sparse_mla_flash_mla_gpu.log" 2>&1
  step pytest_flash_mla $?; tail -12 "$OUT/pytest_sparse_mla_flash_mla_gpu.log"
  timeout 200 python3 scripts/bench_sparse_mla_forward.py --out "$OUT/bench_sparse_mla_forward.json" \
    > "$OUT/bench_sparse_mla_forward.md" 2>&1
  step bench_sparse_mla_forward $?; tail -10 "$OUT/bench_sparse_mla_forward.md"
fi
if want numerics; then  # compile error apart from run-to-run spread: lockstep compiled / eager / eager variant
  timeout 280 python3 scripts/check_compile_numerics.py --config train_configs/k3_small.toml --steps 12 \
    --variant causal_attention=sdpa --out "$OUT/numerics_bf16.json" > "$OUT/numerics_bf16.log" 2>&1
  step numerics_bf16 $?; grep -E "^step|^median" "$OUT/numerics_bf16.log" | cut -c1-200
fi
if want numerics || want numerics_fp32; then  # fp32 master weights: compiled and eager bf16 against the fp32 truth
  # (causal_attention = sdpa in all three: varlen takes no fp32, and its fp32 fallback, flex, runs its dense math
  # eagerly, which ran out of memory at 8,192 tokens and past 280 s at 4,096 in the thirteenth session)
  # NUMERICS_FP32_EXTRA: further overrides (e.g. a shorter --training.seq_len: FLA tunes its fp32 kernels first)
  timeout "${NUMERICS_TIMEOUT:-280}" python3 scripts/check_compile_numerics.py --config train_configs/k3_small.toml \
    --steps "${NUMERICS_STEPS:-12}" --variant "${NUMERICS_FP32_VARIANT:-autocast=off}" --out "$OUT/numerics_fp32.json" -- "${FP32[@]}" \
    --kernels.causal_attention sdpa ${NUMERICS_FP32_EXTRA:-} > "$OUT/numerics_fp32.log" 2>&1
  step numerics_fp32 $?; grep -E "^step|^median" "$OUT/numerics_fp32.log" | cut -c1-200; tail -3 "$OUT/numerics_fp32.log"
fi
if want vl_recipe || want vl_recipe_shipped; then  # image-text: the recipe as shipped (reduce-overhead, bf16),
  # then (vl_recipe) default, fp32 master weights, and the eager fp32-master setting it shipped before the
  # fourteenth session
  recipe train_configs/k31_vl_small.toml k31_vl_small_recipe cold
fi
if want vl_recipe; then
  recipe train_configs/k31_vl_small.toml k31_vl_small_default cold --compile.mode default
  recipe train_configs/k31_vl_small.toml k31_vl_small_fp32 cold "${FP32[@]}"
  recipe train_configs/k31_vl_small.toml k31_vl_small_eager_fp32 cold --compile.mode none "${FP32[@]}"
fi
if want vl_lora; then  # the image-text recipe as shipped with LoRA adapters (base weights frozen)
  recipe train_configs/k31_vl_small.toml k31_vl_small_lora cold --lora.enable true
fi
if want import_profile; then  # where the start-up's imports go (self / cumulative microseconds, top 30)
  python3 -X importtime -c "import titan_kimi.train" 2> "$OUT/importtime_train.txt"
  python3 -X importtime -c "import torch, fla.ops.kda.chunk_fwd, fla.ops.kda.chunk_bwd, liger_kernel.ops.fused_linear_cross_entropy" \
    2> "$OUT/importtime_backends.txt"
  step import_profile $?
  for f in importtime_train importtime_backends; do
    echo "== $f"; sort -t'|' -k2 -n "$OUT/$f.txt" | tail -30 | cut -c1-140
  done
fi
if want cudnn_indexer; then  # kernels.indexer_topk = cudnn: its GPU tests, then the k31_small recipe with it
  timeout -s INT -k 20 300 python3 -m pytest -m gpu --kernels-triton-autotune false tests/test_indexer_topk_cudnn_gpu.py -v -rs -rf \
    > "$OUT/pytest_indexer_topk_cudnn_gpu.log" 2>&1
  step pytest_indexer_topk_cudnn $?; tail -8 "$OUT/pytest_indexer_topk_cudnn_gpu.log"
fi
if want cudnn_dsa_indexer || want cudnn_indexer || want cudnn_dsa; then  # cuDNN's sm90 DSA indexer vs ours
  timeout 400 python3 scripts/bench_cudnn_dsa_indexer.py --out "$OUT/bench_cudnn_dsa_indexer.json" \
    > "$OUT/bench_cudnn_dsa_indexer.md" 2>&1
  step bench_cudnn_dsa_indexer $?; tail -8 "$OUT/bench_cudnn_dsa_indexer.md"
fi
if want cudnn_indexer; then
  recipe train_configs/k31_small.toml k31_small_recipe_cudnn_indexer cold --kernels.indexer_topk cudnn
fi
if want cudnn_kda_grads; then  # which raw gradient of cuDNN's KDA backward is off (against the fp32 reference)
  timeout 120 python3 scripts/check_cudnn_kda_gradients.py > "$OUT/cudnn_kda_gradients.md" 2>&1
  step cudnn_kda_grads $?; cat "$OUT/cudnn_kda_gradients.md"
fi
if want cudnn_kda || want cudnn_kda_bench; then  # cudnn_kda_bench: the speed part alone (its own call)
  timeout "$(want cudnn_kda_bench && echo 500 || echo 170)" python3 scripts/bench_kda.py \
    --shapes ${KDA_SHAPES:-k3_small k3} --layouts ${KDA_LAYOUTS:-docs_padded one_doc_padded} \
    --out "$OUT/bench_kda.json" > "$OUT/bench_kda.md" 2>&1
  step bench_kda $?; tail -24 "$OUT/bench_kda.md"
fi
step done 0
