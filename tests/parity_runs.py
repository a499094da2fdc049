"""The layouts of tests/parallel_parity_worker.py that the CPU tests check, launched together: one torchrun of 4
gloo ranks per pytest run (tests/conftest.py parity_runs), which test_parallel.py, test_context_parallel.py and
test_indexer_training_parallel.py read by name; the same launch first runs tests/cp_layer_worker.py's cases for
test_context_parallel.py. Starting 4 processes (Python, torch, the trainer) once instead of once per test is what
this saves."""

from __future__ import annotations

import re
from pathlib import Path

# test_parallel.py: every layout in fp32, the HF initial weights read per rank among them
FP32_LAYOUTS = ("ep2", "pp2_1f1b", "pp2_interleaved", "pp2_zbv", "pp2_ep2_fsdp2", "pp2_ep2_fsdp2_prefetch",
                "pp2_interleaved_zb", "pp2_looped_bfs", "pp2_dualpipev", "pp2_gpipe", "pp2_ep2_sac_compile",
                "ep2_full_ac", "ep4_hierarchical_full_ac", "ep4_hierarchical_sac_compile",
                "pp2_fsdp2_module_compile", "vl_pp2_fsdp2", "vl_lora_pp2_fsdp2", "vl_lora_pp2_zbv",
                "ep2_efsdp2_hf", "pp2_ep2_hf")
# test_context_parallel.py: CP composed with FSDP, PP and EP
CP_LAYOUTS = ("cp2_dp2", "cp2_contiguous_dp2", "cp4", "cp2_pp2", "cp2_ep2_dp2", "cp2_pp2_ep2")
# test_indexer_training_parallel.py: indexer training under every parallelism
INDEXER_LAYOUTS = ("sparse_pp2_ep2_fsdp2", "sparse_cp2_dp2_sac", "warmup_cp2_pp2", "sparse_ep2_module_compile")
# test_parallel.py: one layout under two settings, compared with each other (the worker's AB_LAYOUTS)
AB_LAYOUTS = ("pp2_ep2_fsdp2_sync_microbatch", "pp2_ep2_fsdp2_sync_microbatch_always",
              "pp2_ep2_fsdp2_sync_microbatch_bf16")
LAYOUTS = (*FP32_LAYOUTS, *CP_LAYOUTS, *INDEXER_LAYOUTS, *AB_LAYOUTS)


class ParityRuns:
    """``runs.output()``: what the one launch printed (rank 0's CP, PARITY, AB, INDEXER and HF_EXPORT lines);
    ``runs.parity(names)``: ``{name: (grad_rel, loss_rel, params)}`` of the PARITY lines of those layouts."""

    def __init__(self, root: Path) -> None:
        self.root, self._out = root, None

    def output(self) -> str:
        if self._out is None:
            import torch

            from titan_kimi.checkpoint import export_hf_checkpoint
            from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
            from tests.test_parallel import launch

            hf = self.root / "hf"  # the initial weights of the *_hf layouts
            torch.manual_seed(5)
            model = KimiK3Model(model_args_for("k31_debug_pp"))
            model.init_weights()
            export_hf_checkpoint(model, hf, dtype=torch.float32)
            self._out = launch(["tests/parallel_parity_worker.py", "--hf", str(hf), "cp_layers", *LAYOUTS], nproc=4,
                               timeout=3600)
        return self._out

    def ab(self, names) -> dict[str, tuple[float, float, int, int]]:
        """``{name: (grad_rel, loss_rel, held by A, held by B)}`` of the AB lines of those layouts."""
        rows = re.findall(r"AB (\S+) grad_rel (\S+) loss_rel (\S+) held (\d+) (\d+)", self.output())
        return {name: (float(g), float(l), int(a), int(b)) for name, g, l, a, b in rows if name in names}

    def parity(self, names) -> dict[str, tuple[str, str, str]]:
        rows = re.findall(r"PARITY (\S+) grad_rel (\S+) loss_rel (\S+) params (\d+)", self.output())
        return {name: tuple(values) for name, *values in rows if name in names}
