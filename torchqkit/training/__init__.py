"""Training with quantization: quantization-aware training (fake quantization, straight-through gradients),
N:M sparse training and float8 training of Linear layers; QAT also trains mixture-of-experts expert stacks."""
from .fake_quantized_experts import FakeQuantizedExperts
from .fake_quantized_linear import FakeQuantizedLinear
from .float8_linear import Float8TrainingLinear
from .float8_static import Float8StaticScales, float8_training_calibration, float8_training_overflows
from .float8_training import enable_float8_training_, float8_training_status
from .lora import LoRALinear, add_lora_
from .qat import convert_qat_, is_qat_prepared, prepare_qat_
from .qat_config import QATConfig
from .sparse_training import SparseTrainingLinear, convert_sparse_, prepare_sparse_

__all__ = ["QATConfig", "prepare_qat_", "convert_qat_", "is_qat_prepared", "FakeQuantizedLinear",
           "FakeQuantizedExperts", "enable_float8_training_", "float8_training_status", "Float8TrainingLinear",
           "Float8StaticScales", "float8_training_calibration", "float8_training_overflows", "LoRALinear", "add_lora_",
           "prepare_sparse_", "convert_sparse_", "SparseTrainingLinear"]
