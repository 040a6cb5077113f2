"""Serialization: safe globals for ``torch.load(weights_only=True)``, and safetensors checkpoints
(save_quantized / load_quantized, quantize_checkpoint) that never unpickle."""
from .checkpoint import quantize_checkpoint
from .safe_globals import register_safe_globals
from .safetensors_file import CheckpointError
from .save_load import FORMAT_VERSION, SaveSummary, load_quantized, read_checkpoint_info, save_quantized

__all__ = ["register_safe_globals", "CheckpointError", "FORMAT_VERSION", "SaveSummary", "load_quantized",
           "quantize_checkpoint", "read_checkpoint_info", "save_quantized"]
