"""Registers, shared memory and spills of our kernels compiled for sm_90a, no GPU needed: python scripts/check/sm90_kernel_resources.py [--json]

What ptxas says about the Gluon sparse-MLA forward (or the triton_op kernels' scalar types). Used by the CPU
tests (the Gluon forward must keep compiling, within shared memory) and by hand while tuning a kernel away from
the GPU machine.

    python3 scripts/check/sm90_kernel_resources.py            # the Gluon sparse-MLA forward at bf16 and fp16
    python3 scripts/check/sm90_kernel_resources.py --json     # the same as one JSON object per line (the CPU test reads it)
    python3 scripts/check/sm90_kernel_resources.py --scalar-types   # the triton_op kernels with float scalars typed fp64 (JSON lines)

Run it without TRITON_INTERPRET=1: under the interpreter the kernels are not compilable objects.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SM90_MAX_SHARED = 232_448  # bytes of dynamic shared memory per block on H100 / H200


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, *, num_warps: int, aligned: tuple[int, ...] = (),
                 num_stages: int = 3) -> dict:
    """Compile `fn` for sm_90a; `aligned` lists argument positions known 16-byte aligned / divisible by 16 (what
    Triton's launcher would specialize on). Returns shared (bytes), regs, spill_stores, spill_loads, ptx."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    else:
        source_type = ASTSource
    src = source_type(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                            "num_stages": num_stages})
    stats = {"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        run = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log[-2000:]}")
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stats["regs"] = int(regs.group(1)) if regs else None
    stats["spill_stores"], stats["spill_loads"] = (int(spills.group(1)), int(spills.group(2))) if spills else (0, 0)
    return stats


def compile_sparse_mla_ws(dtype: str = "bf16") -> dict:
    """The Gluon sparse-MLA forward with its shipped config, pointer and stride arguments aligned as at K3 shapes."""
    from lowerings.kernels.sparse_mla_fwd_ws import WS_CONFIG, _sparse_mla_fwd_ws_kernel

    sig = {"Q": f"*{dtype}", "KV": f"*{dtype}", "IDX": "*i32", "EXT": "*i32", "OUT": f"*{dtype}", "LSE": "*fp32"}
    sig.update({name: "i32" for name in ("stride_qt", "stride_qh", "stride_it", "stride_ot", "stride_oh",
                                         "stride_lt", "H", "S_KV", "N_HB")})
    sig["qk_scale_log2"] = "fp32"
    config = dict(WS_CONFIG, KV_STRIDE=576)
    num_warps = config["num_warps"]
    sig.update({name: "constexpr" for name in config})
    aligned = tuple(range(12))  # pointers and strides (576-multiples at K3 shapes)
    return compile_sm90(_sparse_mla_fwd_ws_kernel, sig, config, num_warps=num_warps, aligned=aligned)


def fp64_arithmetic(ptx: str) -> list[str]:
    """PTX lines computing in fp64: everything with .f64 but the parameter declarations and loads and the one
    conversion of a scalar to fp32."""
    allowed = (".param .f64", "ld.param.f64", "cvt.rn.f32.f64")
    return [ln.strip() for ln in ptx.splitlines() if ".f64" in ln and not any(a in ln for a in allowed)]


def compile_triton_op_kernels() -> dict[str, dict]:
    """The kernels Inductor compiles through torch.library.wrap_triton (situ_glu, attn_res_mix), with their float
    scalars typed fp64 as wrap_triton types a Python float (Triton's own launcher says fp32)."""
    from lowerings.kernels.attn_res_mix import _attn_res_bwd_kernel, _attn_res_fwd_kernel
    from lowerings.kernels.situ_glu import _situ_glu_bwd_kernel, _situ_glu_fwd_kernel

    def i32(*names: str) -> dict[str, str]:
        return {n: "i32" for n in names}

    situ = {"BLOCK_R": 4, "BLOCK_F": 1024}
    attn = {"BLOCK_M": 16, "BLOCK_H": 512}
    cases = {
        "situ_glu_fwd": (_situ_glu_fwd_kernel, {"X": "*bf16", "Y": "*bf16", **i32("stride_x", "stride_y", "N", "F"),
                                                "beta": "fp64", "beta_lin": "fp64"}, situ),
        "situ_glu_bwd": (_situ_glu_bwd_kernel, {"X": "*bf16", "DY": "*bf16", "DX": "*bf16",
                                                **i32("stride_x", "stride_dy", "stride_dx", "N", "F"),
                                                "beta": "fp64", "beta_lin": "fp64"}, situ),
        "attn_res_fwd": (_attn_res_fwd_kernel, {"BANK": "*bf16", "PART": "*bf16", "WG": "*fp32", "OUT": "*bf16",
                                                **i32("stride_bn", "stride_bm", "stride_pn", "stride_on", "M", "HD"),
                                                "eps": "fp64"}, attn),
        "attn_res_bwd": (_attn_res_bwd_kernel, {"BANK": "*bf16", "PART": "*bf16", "WG": "*fp32", "DOUT": "*bf16",
                                                "DBANK": "*bf16", "DPART": "*bf16", "DWG": "*fp32",
                                                **i32("stride_bn", "stride_bm", "stride_pn", "stride_on", "stride_dbn",
                                                      "stride_dbm", "stride_dpn", "stride_dwg", "N", "M", "HD"),
                                                "eps": "fp64", "ROWS_PER_PROG": "i32"}, attn),
    }
    out = {}
    for name, (fn, sig, constexprs) in cases.items():
        sig = dict(sig, **{k: "constexpr" for k in constexprs})
        out[name] = compile_sm90(fn, sig, constexprs, num_warps=8 if name.startswith("attn") else 4)
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("sm90_kernel_resources.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="sm90_kernel_resources_"))
    if "--scalar-types" in sys.argv:
        for name, s in compile_triton_op_kernels().items():
            f64 = fp64_arithmetic(s["ptx"])
            print(json.dumps({"kernel": name, "regs": s["regs"], "fp64_lines": len(f64), "first": f64[:3]}))
        return
    for dtype in ("bf16", "fp16"):
        s = compile_sparse_mla_ws(dtype)
        budgets = sorted(set(re.findall(r"setmaxnreg[.a-z]*u32\s+(\d+)", s["ptx"])))
        if "--json" in sys.argv:
            print(json.dumps({"dtype": dtype, "shared": s["shared"], "regs": s["regs"], "max_shared": SM90_MAX_SHARED,
                              "spill_stores": s["spill_stores"], "spill_loads": s["spill_loads"],
                              "setmaxnreg": budgets, "wgmma": s["ptx"].count("wgmma.mma_async"),
                              "cp_async": s["ptx"].count("cp.async.cg")}))
            continue
        print(f"sparse_mla_fwd_ws {dtype}: shared {s['shared']} B (max {SM90_MAX_SHARED}), regs {s['regs']}, "
              f"spill stores {s['spill_stores']} B, loads {s['spill_loads']} B, "
              f"setmaxnreg {budgets}")


if __name__ == "__main__":
    main()
