"""torchqkit: quantize PyTorch models (weights, and optionally activations) in place.

    import torchqkit as qk
    report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128))
"""
from . import kernels
from .kernels import KernelsMissingWarning
from .api.configs import (AWQConfig, Float8DynamicActivationFloat8WeightConfig,
                          Float8DynamicActivationInt4WeightConfig, Float8StaticActivationFloat8WeightConfig,
                          Float8WeightOnlyConfig, GPTQConfig, Int4DynamicActivationInt4WeightConfig,
                          Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                          Int8DynamicActivationIntxWeightConfig, MXDynamicActivationMXWeightConfig, Int8StaticActivationInt8WeightConfig,
                          Int8WeightOnlyConfig, IntxWeightOnlyConfig, MXFP4WeightOnlyConfig, MXFP8WeightOnlyConfig,
                          NF4WeightOnlyConfig, NVFP4DynamicActivationNVFP4WeightConfig, NVFP4WeightOnlyConfig,
                          FP6WeightOnlyConfig, QuantConfig, SmoothQuantConfig, SparsityConfig, config_from_dict,
                          known_configs)
from .api import presets
from .api.calibrate import CalibrationData
from .api.fuse import fuse_shared_input_linears
from .api.module_configs import ModuleConfigs
from .api.quantize import QuantizationError, quantize_
from .algorithms.rotation import RotationError
from .api.rotate import RotationConfig, RotationReport, rotate_
from .api.quantize_weight import UnsupportedWeight, UnsupportedWeightError, quantize_weight
from .api.report import LayerReport, QuantizationReport
from .core import (MappingType, PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken, ZeroPointDomain,
                   choose_qparams_affine, dequantize_affine, qdtypes, quantize_affine)
from .layouts import FP6Layout, Float8Layout, Layout, MXLayout, NF4Layout, NVFP4Layout, PlainLayout
from .layouts import NMSparseLayout, PackedIntxLayout, TensorCoreTiledLayout
from .hf import from_pretrained, save_pretrained
from .integrations import hf_registration as _hf_registration
from .integrations.gguf import GGUFError, from_gguf
from .integrations.gguf_export import GGUFExportReport, GGUFTensorExport, save_gguf
from .integrations import hub_import as _hub_import  # torchqkit.from_pretrained reads GPTQ / AWQ / compressed-tensors
from .integrations.compressed_tensors_export import CompressedTensorsExport, save_compressed_tensors
from .serialization import CheckpointError, load_quantized, quantize_checkpoint, save_quantized
from .serialization import register_safe_globals as _register_safe_globals
from .training import (FakeQuantizedExperts, FakeQuantizedLinear, Float8StaticScales, Float8TrainingLinear,
                       LoRALinear, QATConfig, SparseTrainingLinear, add_lora_, convert_qat_, convert_sparse_, enable_float8_training_,
                       float8_training_calibration, float8_training_overflows, float8_training_status, prepare_qat_,
                       prepare_sparse_)
from .tensor import ActivationQuantSpec, AffineQuantizedTensor, KernelPreference, UnsupportedOpError
from .distributed import ShardingError, parallelize_experts_, shard_multiple
from .kvcache import KVCacheConfig

from .version import __version__

_register_safe_globals()
_hf_registration.install()  # transformers learns quant_method "torchqkit" (free until transformers is used)

# The public names, by what they are for. dir(torchqkit) lists these (TorchqkitConfig included, imported lazily).
_PUBLIC = {
    "quantize": ["quantize_", "ModuleConfigs", "QuantizationReport", "LayerReport", "CalibrationData",
                 "fuse_shared_input_linears", "quantize_weight", "rotate_", "RotationConfig", "RotationReport"],
    "configs": ["presets", "QuantConfig", "Int8WeightOnlyConfig", "Int4WeightOnlyConfig", "IntxWeightOnlyConfig",
                "NF4WeightOnlyConfig", "MXFP8WeightOnlyConfig", "MXFP4WeightOnlyConfig", "NVFP4WeightOnlyConfig",
                "NVFP4DynamicActivationNVFP4WeightConfig", "FP6WeightOnlyConfig", "Float8WeightOnlyConfig",
                "Int8DynamicActivationInt8WeightConfig", "Int8DynamicActivationIntxWeightConfig",
                "Float8DynamicActivationFloat8WeightConfig", "Int4DynamicActivationInt4WeightConfig",
                "Float8DynamicActivationInt4WeightConfig", "MXDynamicActivationMXWeightConfig",
                "Int8StaticActivationInt8WeightConfig",
                "Float8StaticActivationFloat8WeightConfig", "GPTQConfig", "AWQConfig", "SmoothQuantConfig",
                "SparsityConfig", "config_from_dict", "known_configs"],
    "granularity and numerics": ["PerTensor", "PerAxis", "PerGroup", "PerRow", "PerToken", "PerBlock",
                                 "MappingType", "ZeroPointDomain", "qdtypes", "choose_qparams_affine",
                                 "quantize_affine", "dequantize_affine"],
    "tensor, layouts and kernels": ["AffineQuantizedTensor", "ActivationQuantSpec", "KernelPreference", "Layout",
                                    "PlainLayout", "TensorCoreTiledLayout", "PackedIntxLayout", "NMSparseLayout", "NF4Layout",
                                    "Float8Layout", "MXLayout", "NVFP4Layout", "FP6Layout", "kernels"],
    "checkpoints and integrations": ["save_quantized", "load_quantized", "quantize_checkpoint", "save_pretrained",
                                     "from_pretrained", "from_gguf", "save_gguf", "GGUFExportReport",
                                     "GGUFTensorExport", "TorchqkitConfig", "save_compressed_tensors",
                                     "CompressedTensorsExport"],
    "training": ["QATConfig", "prepare_qat_", "convert_qat_", "FakeQuantizedLinear", "FakeQuantizedExperts",
                 "add_lora_", "LoRALinear", "enable_float8_training_", "float8_training_status", "Float8TrainingLinear", "Float8StaticScales",
                 "float8_training_calibration", "float8_training_overflows", "prepare_sparse_",
                 "convert_sparse_", "SparseTrainingLinear"],
    "distributed": ["shard_multiple", "parallelize_experts_"],
    "KV cache": ["KVCacheConfig", "QuantizedKVCache"],
    "errors and warnings": ["QuantizationError", "CheckpointError", "GGUFError", "ShardingError", "RotationError",
                            "UnsupportedOpError", "UnsupportedWeightError", "KernelsMissingWarning"],
}
__all__ = [name for names in _PUBLIC.values() for name in names] + ["__version__"]


def __getattr__(name):
    # TorchqkitConfig subclasses a transformers class: imported on first use, so torchqkit alone stays light.
    if name == "TorchqkitConfig":
        from .integrations.transformers_quantizer import TorchqkitConfig
        return TorchqkitConfig
    if name == "QuantizedKVCache":  # a transformers Cache subclass: imported on first use, as TorchqkitConfig
        from .kvcache.cache import QuantizedKVCache
        QuantizedKVCache.__module__ = "torchqkit"
        return QuantizedKVCache
    raise AttributeError(f"module 'torchqkit' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | {"UnsupportedWeight"})  # the error's earlier name still works

# Public classes report their public path, so pickles and reprs don't depend on internal file names.
for _cls in (AffineQuantizedTensor, CalibrationData, PlainLayout, ActivationQuantSpec, KernelPreference, ModuleConfigs,
             PackedIntxLayout, NMSparseLayout, TensorCoreTiledLayout,
             QuantizationReport, Float8Layout, MXLayout, NVFP4Layout, FP6Layout, NF4Layout, QATConfig,
             FakeQuantizedLinear, FakeQuantizedExperts, Float8TrainingLinear, Float8StaticScales, KernelsMissingWarning, KVCacheConfig):
    _cls.__module__ = "torchqkit"
del _cls
