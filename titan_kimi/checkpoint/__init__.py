"""Checkpoints: the public HF safetensors layout in (MXFP4 experts dequantised) and out, DCP save/resume."""

from titan_kimi.checkpoint.convert import dcp_to_hf, hf_to_dcp
from titan_kimi.checkpoint.dcp_states import ModelState, OptimizerState, RankLocal, RNGState, training_state
from titan_kimi.checkpoint.destinations import Destination, model_destinations
from titan_kimi.checkpoint.hf_config import hf_config, model_args_from_hf, read_hf_config
from titan_kimi.checkpoint.hf_export import export_hf_checkpoint, hf_tensors_for
from titan_kimi.checkpoint.hf_export_stages import export_hf_stages
from titan_kimi.checkpoint.hf_index import HFCheckpoint
from titan_kimi.checkpoint.hf_load import LoadReport, load_hf_checkpoint
from titan_kimi.checkpoint.initial import checkpoint_format, load_model_weights
from titan_kimi.checkpoint.manager import CheckpointManager
from titan_kimi.checkpoint.mxfp4 import decode_mxfp4, encode_mxfp4
from titan_kimi.checkpoint.progress import ProgressBar
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_text_config, plan_key

__all__ = [
    "CheckpointManager",
    "Destination",
    "HFCheckpoint",
    "LoadReport",
    "ModelState",
    "OptimizerState",
    "ProgressBar",
    "RNGState",
    "RankLocal",
    "checkpoint_format",
    "dcp_to_hf",
    "decode_mxfp4",
    "encode_mxfp4",
    "export_hf_checkpoint",
    "export_hf_stages",
    "hf_config",
    "hf_tensors_for",
    "hf_text_config",
    "hf_to_dcp",
    "load_hf_checkpoint",
    "load_model_weights",
    "model_args_from_hf",
    "model_destinations",
    "plan_key",
    "read_hf_config",
    "training_state",
]
