"""Quantization-aware training: train through the int4 quantizer, then convert to real int4 weights.

Run: python tutorials/06_qat.py   (CPU; a small MLP; about 4 s on 2 cores)

prepare_qat_ swaps each Linear for a FakeQuantizedLinear whose forward uses the weight as int4 would store it
(straight-through gradients); convert_qat_ then quantizes with the same config, so the int4 model computes what the
last training forward did.
"""
import copy

import torch
from torch import nn

import torchqkit as qk

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
x_train, x_test = torch.randn(4096, 64), torch.randn(512, 64)
with torch.no_grad():
    y_train, y_test = teacher(x_train), teacher(x_test)
config = qk.Int4WeightOnlyConfig(group_size=32)


def test_error(model) -> float:
    with torch.no_grad():
        return ((model(x_test) - y_test).norm() / y_test.norm()).item()


# Round-to-nearest: quantize the trained float weights as they are.
rtn = copy.deepcopy(teacher)
qk.quantize_(rtn, config)

# QAT: fine-tune a copy through the fake quantizer towards the float model's outputs, then convert.
student = copy.deepcopy(teacher).train()
qk.prepare_qat_(student, qk.QATConfig(config))
# Small steps: an int4 step here is about 0.016, and larger updates move weights across it at random.
optimizer = torch.optim.SGD(student.parameters(), lr=0.02, momentum=0.9)
for step in range(300):
    batch = torch.randint(0, 4096, (256,))
    loss = nn.functional.mse_loss(student(x_train[batch]), y_train[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
report = qk.convert_qat_(student.eval())
print(report)

print(f"relative test error, round-to-nearest int4: {test_error(rtn):.4f}")
print(f"relative test error, QAT int4:              {test_error(student):.4f}")
assert test_error(student) < test_error(rtn)
print("weights:", type(student[0].weight).__name__)
