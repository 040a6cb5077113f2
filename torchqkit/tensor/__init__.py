"""AffineQuantizedTensor and what its dispatch needs."""
from .activation import ActivationQuantSpec, KernelPreference
from .affine_quantized_tensor import AffineQuantizedTensor
from .dispatch import OpTable, UnsupportedOpError
from . import generic_ops  # noqa: F401  (registers the generic op table)
from . import expert_ops  # noqa: F401  (registers the op table of expert stacks)
