"""What users call: quantize_, configs, per-module configs, the report."""
from .configs import *  # noqa: F401,F403  (the config classes are the public API)
from .fuse import fuse_shared_input_linears
from .module_configs import ModuleConfigs
from .quantize import QuantizationError, quantize_
from .quantize_weight import UnsupportedWeight, quantize_weight
from .report import LayerReport, QuantizationReport
