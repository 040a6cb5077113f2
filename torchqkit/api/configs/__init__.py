"""Config classes; importing this package registers every config with its handler."""
from .base import QuantConfig, config_from_dict, handler_for, known_configs, recipe_for
from .dynamic_activation import Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig
from .float8 import (Float8DynamicActivationFloat8WeightConfig, Float8StaticActivationFloat8WeightConfig,
                     Float8WeightOnlyConfig)
from .integer import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
from .fp6 import FP6WeightOnlyConfig
from .int4_dynamic_activation import Float8DynamicActivationInt4WeightConfig, Int4DynamicActivationInt4WeightConfig
from .mx import MXDynamicActivationMXWeightConfig, MXFP4WeightOnlyConfig, MXFP8WeightOnlyConfig
from .nvfp4 import NVFP4DynamicActivationNVFP4WeightConfig, NVFP4WeightOnlyConfig
from .nf4 import NF4WeightOnlyConfig
from .static_activation import Int8StaticActivationInt8WeightConfig
from .calibrated import AWQConfig, CalibratedConfig, GPTQConfig, SmoothQuantConfig
from .sparsity import SparsityConfig
