"""torchqkit quickstart: quantize a small MLP, run it eager and compiled, save and load it.

Run: python tutorials/01_quickstart.py   (CPU; about 8 s on 2 cores, most of it torch.compile)
"""

import copy
import tempfile

import torch
from torch import nn

import torchqkit


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: higher is closer to float (int4 ~ 20 dB, int8 ~ 40 dB)."""
    return (20 * torch.log10(ref.norm() / (ref - out).norm())).item()


def make_mlp() -> nn.Sequential:
    # Linear layers named "0" and "2" (their index in the Sequential); K = 256 and 1024, multiples of 32.
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


torch.manual_seed(0)
float_model = make_mlp().eval()
x = torch.randn(8, 256)

# 1. One config for every nn.Linear: int4 weights, one scale + zero point per group of 32 inputs.
int4_model = copy.deepcopy(float_model)
print(torchqkit.quantize_(int4_model, torchqkit.presets.get("int4-wo-g32")))  # = Int4WeightOnlyConfig(group_size=32)

# 2. A config per module (by FQN); "_default" covers every Linear not named.
mixed_model = copy.deepcopy(float_model)
mixed = torchqkit.ModuleConfigs(
    {"0": torchqkit.Int8WeightOnlyConfig(), "_default": torchqkit.Int4WeightOnlyConfig(group_size=32)}
)
print(torchqkit.quantize_(mixed_model, mixed))

# 3. Run eager and compiled. no_grad: inference only, so compile traces no backward graph.
with torch.no_grad():
    ref = float_model(x)
    for name, model in [("int4 g32", int4_model), ("int8 + int4", mixed_model)]:
        eager = model(x)
        compiled = torch.compile(model)(x)
        print(f"{name}: SQNR eager {sqnr_db(ref, eager):.1f} dB, compiled {sqnr_db(ref, compiled):.1f} dB")

# 4. Save the quantized state dict, load it without pickle into a fresh model built on the meta device.
with tempfile.NamedTemporaryFile(suffix=".pt") as f:
    torch.save(mixed_model.state_dict(), f.name)
    state_dict = torch.load(f.name, weights_only=True)
with torch.device("meta"):
    loaded = make_mlp().eval()
loaded.load_state_dict(state_dict, assign=True)  # assign: take the quantized tensors as they are
with torch.no_grad():
    assert torch.equal(loaded(x), mixed_model(x))
print("reloaded model matches:", type(loaded[0].weight).__name__)
