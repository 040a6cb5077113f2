"""Numerics: quantized dtypes, granularities, calibration and the pure-PyTorch oracle."""
from . import qdtype as qdtypes
from .calibration import Calibration, parse_calibration
from .granularity import (Granularity, PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken,
                          validate_block_size)
from .primitives import (MappingType, ZeroPointDomain, choose_qparams_affine, code_midpoint,
                         default_zero_point_domain, dequantize_affine, quantize_affine)
from .qdtype import QDType, QKind, all_qdtypes, qdtype_from_name
