"""torchqkit: quantize PyTorch models (weights, and optionally activations) in place.

    import torchqkit as qk
    report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=128))
"""
from . import kernels
from .kernels import KernelsMissingWarning
from .api.configs import (AWQConfig, Float8DynamicActivationFloat8WeightConfig,
                          Float8StaticActivationFloat8WeightConfig, Float8WeightOnlyConfig, GPTQConfig,
                          Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                          Int8DynamicActivationIntxWeightConfig, Int8StaticActivationInt8WeightConfig,
                          Int8WeightOnlyConfig, IntxWeightOnlyConfig, MXFP4WeightOnlyConfig, MXFP8WeightOnlyConfig,
                          NF4WeightOnlyConfig, QuantConfig, SmoothQuantConfig, config_from_dict, known_configs)
from .api.calibrate import CalibrationData
from .api.fuse import fuse_shared_input_linears
from .api.module_configs import ModuleConfigs
from .api.quantize import QuantizationError, quantize_
from .api.quantize_weight import UnsupportedWeight, quantize_weight
from .api.report import LayerReport, QuantizationReport
from .core import (MappingType, PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken, ZeroPointDomain,
                   choose_qparams_affine, dequantize_affine, qdtypes, quantize_affine)
from .layouts import Float8Layout, Layout, MXLayout, NF4Layout, PlainLayout
from .layouts import PackedIntxLayout, TensorCoreTiledLayout
from .hf import from_pretrained, save_pretrained
from .integrations import hf_registration
from .integrations.gguf import GGUFError, from_gguf
from .serialization import (CheckpointError, load_quantized, quantize_checkpoint, register_safe_globals,
                            save_quantized)
from .training import (FakeQuantizedLinear, Float8TrainingLinear, LoRALinear, QATConfig, add_lora_, convert_qat_,
                       enable_float8_training_, float8_training_status, prepare_qat_)
from .tensor import ActivationQuantSpec, AffineQuantizedTensor, KernelPreference, UnsupportedOpError
from .distributed import ShardingError, shard_multiple

from .version import __version__

register_safe_globals()
hf_registration.install()  # transformers learns quant_method "torchqkit" (free until transformers is used)


def __getattr__(name):
    # TorchqkitConfig subclasses a transformers class: imported on first use, so torchqkit alone stays light.
    if name == "TorchqkitConfig":
        from .integrations.transformers_quantizer import TorchqkitConfig
        return TorchqkitConfig
    raise AttributeError(f"module 'torchqkit' has no attribute {name!r}")

# Public classes report their public path, so pickles and reprs don't depend on internal file names.
for _cls in (AffineQuantizedTensor, CalibrationData, PlainLayout, ActivationQuantSpec, KernelPreference, ModuleConfigs,
             PackedIntxLayout, TensorCoreTiledLayout,
             QuantizationReport, Float8Layout, MXLayout, NF4Layout, QATConfig, FakeQuantizedLinear,
             Float8TrainingLinear, KernelsMissingWarning):
    _cls.__module__ = "torchqkit"
del _cls
