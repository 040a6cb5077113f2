"""Make transformers know quant_method "torchqkit" as soon as both packages are in use, at no import cost.

Registering means importing transformers' quantizer machinery (about 2 s). So ``import torchqkit`` registers at
once only when that machinery is already imported; otherwise it leaves a finder on ``sys.meta_path`` that
registers right after transformers imports ``transformers.quantizers.auto`` itself, which it does before it
resolves any quantization_config. A user of torchqkit without transformers pays nothing. The installed package
also runs that finder at interpreter start, so that processes that never import torchqkit register too: see
Note [Registering with transformers at interpreter start] in _torchqkit_startup.py, which holds the finder.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

import _torchqkit_startup

__all__ = ["install", "register", "register_or_warn"]

_QUANTIZER_MODULE = "torchqkit.integrations.transformers_quantizer"


def install() -> None:
    """Register now if transformers' quantizers are imported, else when they are; no-op without transformers."""
    if _torchqkit_startup.TRIGGER not in sys.modules:
        try:
            if importlib.util.find_spec("transformers") is None:
                return
        except (ImportError, ValueError):
            return
    _torchqkit_startup.install()


def register() -> None:
    """Register TorchqkitConfig and TorchqkitHfQuantizer with transformers (idempotent)."""
    module = sys.modules.get(_QUANTIZER_MODULE)
    if module is not None and not hasattr(module, "register_with_transformers"):
        return  # that module is being imported; it registers itself when done
    importlib.import_module(_QUANTIZER_MODULE).register_with_transformers()


def register_or_warn() -> None:
    """Registration runs inside transformers' own import: a transformers torchqkit can't plug into (4.x has no
    WeightConverter loading) must still import, so a failure here is a warning, never an exception."""
    try:
        register()
    except Exception as e:  # noqa: BLE001 - any failure: transformers must keep working without us
        import transformers
        warnings.warn(f"torchqkit: could not register quant_method 'torchqkit' with transformers "
                      f"{getattr(transformers, '__version__', '?')} ({type(e).__name__}: {e}); transformers' "
                      f"from_pretrained won't read torchqkit checkpoints (torchqkit.from_pretrained still does). "
                      f"torchqkit's transformers integration needs transformers >= 5", stacklevel=2)
