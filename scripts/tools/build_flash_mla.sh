#!/usr/bin/env bash
# Builds DeepSeek's FlashMLA sm90 sparse forward offline (kernels.sparse_mla = flash_mla): bash scripts/tools/build_flash_mla.sh pack|build
#   bash scripts/tools/build_flash_mla.sh pack FLASHMLA CUTLASS [OUT.tar.xz]     (where the sources are; needs git, xz)
#   bash scripts/tools/build_flash_mla.sh build SRC TARGET [minimal|full]        (on the GPU machine; no network)
#
# pack: FLASHMLA and CUTLASS are git directories (bare ones work: `git --git-dir`) or plain source folders.
#   From a FlashMLA git directory, cutlass is taken at the commit FlashMLA's csrc/cutlass submodule pins (the
#   CUTLASS git directory must hold it). Only what a build reads goes in: FlashMLA's setup.py, LICENSE, csrc/
#   and flash_mla/ (the Python package), cutlass's include/, tools/util/include/ and LICENSE.txt, and SOURCE.txt
#   naming both commits; xz -9 (about 1.5 MB). Default OUT: .src/flash_mla_src.tar.xz in the repo.
#
# build: SRC is a tarball made by `pack`, or a FlashMLA folder whose csrc/cutlass holds cutlass. TARGET gets the
#   `flash_mla` package (put it on PYTHONPATH). Needs python3 with a CUDA torch (and its headers), nvcc >= 12.8,
#   ninja (else one file at a time). MAX_JOBS (default: the core count) parallel compiles; PYTHON picks the
#   interpreter; FLASH_MLA_BUILD_DIR keeps the extracted sources and objects (default: a temp dir, removed).
#   minimal (default): FlashMLA's unchanged Python package over a binding of our own
#     (scripts/tools/flash_mla_sparse_sm90_binding.cpp) compiled with only the two sm90 sparse prefill kernels at
#     d_qk 576 (csrc/sm90/prefill/sparse/instantiations/phase1_k576{,_topklen}.cu): 3 translation units, the
#     two kernels compiled in parallel, a few minutes. flash_mla_sparse_fwd works; every other entry point of
#     FlashMLA raises AttributeError (titan_kimi calls only this one).
#   full: FlashMLA's own setup.py with FLASH_MLA_DISABLE_SM100=1 FLASH_MLA_DISABLE_FP16=1 (sm_90a code only):
#     the whole library (24 translation units, among them the sm100 sources compiled for sm90 and the sparse FP8
#     decode kernels), many times the minimal build's compile; the fallback should the minimal binding ever
#     diverge from FlashMLA's API.
# Exits non-zero with the reason on any failure; prints the elapsed time.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"
BINDING="$SCRIPT_DIR/flash_mla_sparse_sm90_binding.cpp"
PYTHON="${PYTHON:-python3}"
START=$(date +%s)

die() { echo "build_flash_mla.sh: error: $*" >&2; exit 1; }
elapsed() { echo "build_flash_mla.sh: $1 in $(( $(date +%s) - START )) s"; }
usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

is_git_dir() { git --git-dir="$1" rev-parse --verify -q HEAD^{commit} >/dev/null 2>&1; }

# ------------------------------------------------------------------------------------------------ pack
pack() {
    [[ $# -ge 2 && $# -le 3 ]] || usage
    local fm="$1" cut="$2" out="${3:-$REPO_DIR/.src/flash_mla_src.tar.xz}"
    command -v xz >/dev/null || die "xz is not installed"
    STAGE="$(mktemp -d)"
    trap 'rm -rf "$STAGE"' EXIT
    local root="$STAGE/flash_mla_src" fm_rev="unknown (plain folder)" pin="" cut_rev="unknown (plain folder)"
    mkdir -p "$root/FlashMLA/csrc/cutlass"

    if is_git_dir "$fm"; then
        fm_rev="$(git --git-dir="$fm" rev-parse HEAD)"
        pin="$(git --git-dir="$fm" ls-tree HEAD csrc/cutlass | awk '$2 == "commit" {print $3}')"
        [[ -n "$pin" ]] || die "$fm: no csrc/cutlass submodule commit in HEAD's tree"
        git --git-dir="$fm" archive --format=tar HEAD setup.py LICENSE csrc flash_mla \
            | tar -x -C "$root/FlashMLA" || die "git archive of FlashMLA ($fm) failed"
    elif [[ -f "$fm/setup.py" && -d "$fm/csrc" && -d "$fm/flash_mla" ]]; then
        (cd "$fm" && tar -c --exclude=csrc/cutlass setup.py LICENSE csrc flash_mla) | tar -x -C "$root/FlashMLA" \
            || die "copying FlashMLA from $fm failed"
    else
        die "$fm is neither a FlashMLA git directory nor a folder with setup.py, csrc/ and flash_mla/"
    fi
    rm -rf "$root/FlashMLA/csrc/cutlass" && mkdir -p "$root/FlashMLA/csrc/cutlass"

    if is_git_dir "$cut"; then
        local rev="${pin:-HEAD}"
        git --git-dir="$cut" cat-file -e "$rev^{commit}" 2>/dev/null \
            || die "cutlass commit $rev (pinned by FlashMLA) is not in $cut"
        cut_rev="$(git --git-dir="$cut" rev-parse "$rev^{commit}")"
        # (a snapshot without cutlass's large media/ blobs makes git archive complain about them: not archived)
        git --git-dir="$cut" archive --format=tar "$cut_rev" include tools/util/include LICENSE.txt \
            2> >(grep -v "^error: invalid object .* for 'media/" >&2) \
            | tar -x -C "$root/FlashMLA/csrc/cutlass" || die "git archive of cutlass ($cut) failed"
    elif [[ -d "$cut/include/cute" && -d "$cut/tools/util/include" ]]; then
        [[ -z "$pin" ]] || echo "build_flash_mla.sh: warning: FlashMLA pins cutlass $pin; $cut is a plain folder," \
            "its version is not checked" >&2
        (cd "$cut" && tar -c include tools/util/include LICENSE.txt) | tar -x -C "$root/FlashMLA/csrc/cutlass" \
            || die "copying cutlass from $cut failed"
    else
        die "$cut is neither a cutlass git directory nor a folder with include/cute and tools/util/include"
    fi
    [[ -z "$pin" || "$pin" == "$cut_rev" || "$cut_rev" == unknown* ]] || die "cutlass $cut_rev != pin $pin"

    printf 'FlashMLA %s\ncutlass %s\npacked by titan_kimi scripts/tools/build_flash_mla.sh on %s\n' \
        "$fm_rev" "$cut_rev" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$root/SOURCE.txt"
    for f in FlashMLA/setup.py FlashMLA/flash_mla/__init__.py FlashMLA/flash_mla/flash_mla_interface.py \
             FlashMLA/csrc/sm90/prefill/sparse/phase1.cuh \
             FlashMLA/csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu \
             FlashMLA/csrc/cutlass/include/cute/tensor.hpp; do
        [[ -f "$root/$f" ]] || die "packed tree lacks $f"
    done
    mkdir -p "$(dirname "$out")"
    tar -C "$STAGE" -c flash_mla_src | xz -9 -T0 > "$out.tmp" && mv "$out.tmp" "$out" || die "writing $out failed"
    cat "$root/SOURCE.txt"
    echo "build_flash_mla.sh: wrote $out ($(du -h "$out" | cut -f1), $(stat -c %s "$out") bytes)"
}

# ------------------------------------------------------------------------------------------------ build
build() {
    [[ $# -ge 2 && $# -le 3 ]] || usage
    local src="$1" target="$2" mode="${3:-minimal}"
    [[ "$mode" == minimal || "$mode" == full ]] || die "mode must be minimal or full, got '$mode'"
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found"

    local work="${FLASH_MLA_BUILD_DIR:-}"
    if [[ -z "$work" ]]; then
        work="$(mktemp -d)"
        BUILD_TMP="$work"  # global: the EXIT trap runs after this function's locals are gone (set -u)
        trap 'rm -rf "$BUILD_TMP"' EXIT
    fi
    mkdir -p "$work" "$target"
    work="$(cd "$work" && pwd)"
    target="$(cd "$target" && pwd)"

    local fm
    if [[ -f "$src" ]]; then
        tar -xJf "$src" -C "$work" || die "cannot extract $src"
        fm="$work/flash_mla_src/FlashMLA"
        cat "$work/flash_mla_src/SOURCE.txt" 2>/dev/null || true
    elif [[ -d "$src" ]]; then
        fm="$(cd "$src" && pwd)"
    else
        die "$src is neither a tarball from 'pack' nor a FlashMLA folder"
    fi
    [[ -f "$fm/setup.py" && -f "$fm/flash_mla/flash_mla_interface.py" ]] || die "$fm is not a FlashMLA source tree"
    [[ -f "$fm/csrc/cutlass/include/cute/tensor.hpp" ]] \
        || die "$fm/csrc/cutlass has no cutlass headers (include/cute/tensor.hpp): pack with a cutlass checkout"

    # torch with CUDA, its headers, and an nvcc that builds sm_90a
    "$PYTHON" - <<'EOF' || die "$PYTHON cannot build CUDA extensions here (the line above says why)"
import os, shutil, sys
import torch
from torch.utils import cpp_extension as ce
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} has no CUDA")
if ce.CUDA_HOME is None:
    sys.exit("CUDA_HOME not found (set CUDA_HOME or put nvcc on PATH)")
if not os.path.isfile(os.path.join(ce.include_paths()[0], "torch", "extension.h")):
    sys.exit("torch's C++ headers are missing")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={ce.CUDA_HOME}, "
      f"ninja={'yes' if shutil.which('ninja') else 'no (slow, serial build)'}")
EOF
    export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    export TORCH_CUDA_ARCH_LIST="9.0a"
    rm -rf "$target/flash_mla"
    echo "build_flash_mla.sh: $mode build of $fm into $target (MAX_JOBS=$MAX_JOBS)"

    if [[ "$mode" == full ]]; then
        # FlashMLA's setup.py runs `git submodule update` (harmless failure without .git) and compiles all of it.
        (cd "$fm" && FLASH_MLA_DISABLE_SM100=1 FLASH_MLA_DISABLE_FP16=1 NVCC_THREADS="${NVCC_THREADS:-1}" \
            "$PYTHON" setup.py build_ext --build-lib "$target" --build-temp "$work/temp") \
            || die "FlashMLA's setup.py build_ext failed (full build)"
    else
        [[ -f "$BINDING" ]] || die "missing $BINDING"
        FM="$fm" BINDING="$BINDING" TARGET="$target" WORK="$work" "$PYTHON" - <<'EOF' \
            || die "compiling the minimal FlashMLA sparse prefill extension failed"
import os
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

fm = os.environ["FM"]
csrc = os.path.join(fm, "csrc")
inst = os.path.join(csrc, "sm90", "prefill", "sparse", "instantiations")
flags = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]
nvcc = flags + [  # FlashMLA setup.py's nvcc flags, sm_90a only, without -lineinfo/--source-in-ptx/ptxas -v
    "-D_USE_MATH_DEFINES", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
    "--expt-extended-lambda", "--use_fast_math", "--ptxas-options=--register-usage-level=10,--warn-on-spills",
    "-gencode", "arch=compute_90a,code=sm_90a",
]
setup(
    name="flash_mla_sm90_sparse_prefill",
    ext_modules=[CUDAExtension(
        name="flash_mla.cuda",
        sources=[os.environ["BINDING"], os.path.join(inst, "phase1_k576.cu"),
                 os.path.join(inst, "phase1_k576_topklen.cu")],
        include_dirs=[csrc, os.path.join(csrc, "kerutils", "include"), os.path.join(csrc, "sm90"),
                      os.path.join(csrc, "cutlass", "include"),
                      os.path.join(csrc, "cutlass", "tools", "util", "include")],
        extra_compile_args={"cxx": flags, "nvcc": nvcc},
    )],
    cmdclass={"build_ext": BuildExtension},
    script_args=["build_ext", "--build-lib", os.environ["TARGET"],
                 "--build-temp", os.path.join(os.environ["WORK"], "temp")],
)
EOF
    fi

    mkdir -p "$target/flash_mla"
    cp "$fm"/flash_mla/*.py "$target/flash_mla/" || die "copying FlashMLA's python package failed"
    ls "$target"/flash_mla/cuda*.so >/dev/null 2>&1 || die "no flash_mla/cuda*.so was produced in $target"
    { echo "mode $mode"; cat "$work/flash_mla_src/SOURCE.txt" 2>/dev/null || echo "FlashMLA from $fm"; } \
        > "$target/flash_mla/BUILD_INFO.txt"
    # the extension must load against this torch (an ABI mismatch shows here, not mid-training)
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
        "import flash_mla, flash_mla.cuda as c; flash_mla.flash_mla_sparse_fwd; c.sparse_prefill_fwd
print('import ok:', flash_mla.__file__)" \
        || die "the built flash_mla does not import from $target"
    elapsed "built flash_mla ($mode) into $target"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    build) shift; build "$@" ;;
    *) usage ;;
esac
