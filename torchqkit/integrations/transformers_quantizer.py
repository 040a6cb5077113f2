"""transformers' quantizer for quant_method "torchqkit": load, quantize on load, and save through transformers.

    model = AutoModelForCausalLM.from_pretrained("int4-dir")            # a torchqkit checkpoint, as saved
    model = AutoModelForCausalLM.from_pretrained("float-dir",
                quantization_config=qk.TorchqkitConfig(qk.Int4WeightOnlyConfig()))   # quantized while loading
    model.save_pretrained("out")                                        # a torchqkit checkpoint again

Loading a checkpoint: the headers of its files are read and validated (format version, layouts, shapes) before
transformers reads any tensor; each quantized weight's stored tensors ("<name>:<inner>", see Note [torchqkit
safetensors format]) are then gathered by one transformers WeightConverter per weight and become the
AffineQuantizedTensor straight away: the float weight is never built (the model skeleton is on the meta device).

Quantizing on load: transformers hands each float Linear weight to TorchqkitQuantize as it reads it, which plans
it with the same quantize_layer that quantize_ uses and keeps only the quantized result, so peak memory is about
the quantized model plus one float tensor. Shared weights (a tied lm_head) are decided once loading is done, by
complete_quantization_, and the model gets the report quantize_ would give (``model.torchqkit_report``).

Saving: ``model.save_pretrained`` writes the tensors and header of torchqkit's own format (flat_state_dict), and
config.json the quantization_config that torchqkit.save_pretrained writes; both loaders read either result.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

from torch import nn
from transformers.core_model_loading import ConversionOps, PrefixChange, WeightConverter
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..api.after_quantize import register_after_quantize
from ..api.configs.base import QuantConfig, handler_for
from ..api.module_configs import ModuleConfigs
from ..api.quantize import as_module_configs, complete_quantization_, patch_extra_repr, quantize_layer
from ..hf import (QUANT_METHOD, check_format_version, check_quantization_config, quantization_record,
                  read_config_json)
from ..serialization.entries import INNER_SEP
from ..serialization.safetensors_file import CheckpointError
from ..serialization.save_load import (FORMAT_VERSION, check_against_model, decode_config, encode_config,
                                       flat_state_dict, open_checkpoint, read_quantized_weight)
from ..serialization.save_load import torchqkit_version as current_version
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor

__all__ = ["TorchqkitConfig", "TorchqkitHfQuantizer", "register_with_transformers", "adopt_quantized_model"]


class TorchqkitConfig(QuantizationConfigMixin):
    """``quantization_config=`` for transformers' ``from_pretrained``: quantize every Linear with a torchqkit config
    while the model loads.

    Importing torchqkit registers quant_method ``"torchqkit"`` with transformers. Given to ``from_pretrained`` with a
    float checkpoint, each Linear weight is quantized as it is read (peak memory about the quantized model plus
    one float tensor), and ``model.torchqkit_report`` holds the report ``quantize_`` would give. Loaded from a
    torchqkit checkpoint's config.json it also carries what ``save_pretrained`` recorded; ``model.save_pretrained``
    then writes a torchqkit checkpoint again. Configs that need calibration data can't quantize while loading.
    Imported lazily (``qk.TorchqkitConfig``), so torchqkit alone doesn't import transformers.

    Args:
        config (QuantConfig | ModuleConfigs | dict | None): the config to quantize with, or its dict as recorded
            in config.json (decoded); None (default) only when loading a torchqkit checkpoint.
        quant_method (str): must be ``"torchqkit"`` (the default). Keyword-only, as are the arguments below.
        format_version (int): the checkpoint format version; default the current one. Newer versions are refused.
        torchqkit_version (str | None): the torchqkit version that wrote the checkpoint; None (default): this one.
        quantized (list[str] | None): modules whose weight is quantized (recorded by ``save_pretrained``); default
            None (empty).
        modules_not_to_convert (list[str] | None): Linear modules left in float (recorded); default None (empty).
        tied (dict[str, str] | None): tied tensor aliases stored once (recorded); default None (empty).
        strict (bool): when quantizing on load, raise ``QuantizationError`` if a selected layer can't be quantized
            instead of reporting it; default False.

    Raises:
        ValueError: ``quant_method`` is not ``"torchqkit"``.
        TypeError: ``config`` is not a QuantConfig, ModuleConfigs, config dict or None.
        CheckpointError: an invalid ``format_version`` (or one newer than this torchqkit reads).

    Example:
        ```python
        from transformers import AutoModelForCausalLM
        import torchqkit as qk
        model = AutoModelForCausalLM.from_pretrained(
            "float-dir", quantization_config=qk.TorchqkitConfig(qk.Int4WeightOnlyConfig(group_size=128)))
        print(model.torchqkit_report)
        model.save_pretrained("int4-dir")
        ```
    """

    def __init__(self, config=None, *, quant_method: str = QUANT_METHOD, format_version: int = FORMAT_VERSION,
                 torchqkit_version: str | None = None, quantized: list[str] | None = None,
                 modules_not_to_convert: list[str] | None = None, tied: dict[str, str] | None = None,
                 strict: bool = False):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"TorchqkitConfig: quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        if isinstance(config, dict):  # as recorded in config.json
            config = decode_config("config.json quantization_config", config)
        if config is not None and not isinstance(config, (QuantConfig, ModuleConfigs)):
            raise TypeError(f"TorchqkitConfig takes a torchqkit QuantConfig or ModuleConfigs (e.g. "
                            f"qk.Int4WeightOnlyConfig()), got {type(config).__name__}")
        check_format_version(format_version, "TorchqkitConfig")
        self.quant_method = QUANT_METHOD
        self.config = config
        self.format_version = format_version
        self.torchqkit_version = torchqkit_version or current_version()
        self.quantized = list(quantized or [])
        self.modules_not_to_convert = list(modules_not_to_convert or [])
        self.tied = dict(tied or {})
        self.strict = strict

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        """transformers builds the config of a checkpoint's config.json here, before any weight is read: the same
        validation torchqkit.from_pretrained runs (Note [One validation for both loaders], hf.py)."""
        check_quantization_config(config_dict, "config.json: quantization_config")
        return super().from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "format_version": self.format_version,
                "torchqkit_version": self.torchqkit_version, "config": encode_config(self.config),
                "quantized": list(self.quantized), "modules_not_to_convert": list(self.modules_not_to_convert),
                "tied": dict(self.tied), **({"strict": True} if self.strict else {})}

    def __eq__(self, other):
        return isinstance(other, TorchqkitConfig) and self.to_dict() == other.to_dict()


class TorchqkitHfQuantizer(HfQuantizer):
    """Loads torchqkit checkpoints and quantizes float ones while transformers loads them (module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: TorchqkitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.checkpoint = None      # the validated headers of a torchqkit checkpoint being loaded
        self.loaded = {}            # module name -> LayerReport, for layers quantized while loading
        self.configs = None

    # -------------------------------------------------------------------------------------------- checks

    def validate_environment(self, *args, device_map=None, **kwargs):
        if not self.pre_quantized and self.quantization_config.config is None:
            raise ValueError("TorchqkitConfig(): give the config to quantize with, e.g. "
                             "qk.TorchqkitConfig(qk.Int4WeightOnlyConfig()), or a ModuleConfigs")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("torchqkit: device_map sends modules to 'disk'; disk offload of quantized weights is not "
                             "supported. Use device_map='cpu' (or one device)")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if self.pre_quantized:
            self.checkpoint = _open_checkpoint_of(checkpoint_files)
            try:
                _check_config_json(self.checkpoint.path.parent)
                check_against_model(self.checkpoint, model.state_dict(keep_vars=True))  # reads headers only
            finally:
                self.checkpoint.close()  # headers are all we need: transformers reads the tensors
                self.checkpoint.readers = {}  # closed files can't be pickled with the model (torch.save(model))
            # config.json's copy has its keys sorted by transformers; "re:" patterns are tried in order, so the
            # header's copy (in the order the user wrote) is the one to keep and to save again.
            self.quantization_config.config = self.checkpoint.config
        else:
            self.configs = as_module_configs(self.quantization_config.config)
            for c in self.configs.configs.values():
                if c is not None:
                    handler_for(c)
                if c is not None and c.needs_calibration_data():
                    raise ValueError(f"TorchqkitConfig: {type(c).__name__} needs calibration data, which quantizing "
                                     f"while transformers loads can't provide. Load the float model, then "
                                     f"qk.quantize_(model, config, calibration_data=batches) and save it "
                                     f"(model.save_pretrained); that checkpoint loads here")
        return model

    # -------------------------------------------------------------------------------------------- loading

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        """Every "weight:<inner>" suffix the checkpoint stores: one converter gathers a weight's tensors."""
        if not self.pre_quantized or self.checkpoint is None:
            return {}
        # Keyed by the Parameter's attribute: "weight" for Linears, "gate_up_proj" / "down_proj" / ... for stacks of
        # experts (Note [Expert weights] in tensor/experts.py).
        names: dict[str, set[str]] = {}
        for name, inners in self.checkpoint.inner.items():
            attr = name.rpartition(".")[2]
            names.setdefault(attr, set()).update(f"{attr}{INNER_SEP}{inner}" for inner in inners)
        return {attr: sorted(n) for attr, n in names.items()}

    def get_load_operations(self) -> dict:
        return {"deserialize": TorchqkitDeserialize}

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return self.checkpoint is not None and param_name in self.checkpoint.weights
        module_name, _, attr = param_name.rpartition(".")
        if attr != "weight" or param_name in _tied_keys(model):  # ties are decided when everything is loaded
            return False
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        return isinstance(module, nn.Linear) and self.configs.lookup(module_name)[1] is not None

    def get_quantize_ops(self):
        return TorchqkitQuantize(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        # The converters that gathered "<name>:<inner>" tensors can't be reversed on save, and need not be:
        # get_state_dict_and_metadata writes those names itself.
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:
            model._weight_conversions = [c for c in conversions if not any(
                isinstance(op, TorchqkitDeserialize) for op in getattr(c, "operations", ()))]
        if self.pre_quantized:
            _check_loaded(self.checkpoint, model)
            self.checkpoint = None  # loading is over; the model keeps this quantizer (model.hf_quantizer)
            return model
        report = complete_quantization_(model, self.configs, self.loaded, strict=self.quantization_config.strict)
        model.torchqkit_report = report
        return model

    # -------------------------------------------------------------------------------------------- saving

    def get_state_dict_and_metadata(self, model):
        _keep_expert_stacks_whole(model)
        qc = self.quantization_config
        tensors, metadata, tied = flat_state_dict(model, qc.config)
        record = quantization_record(model, qc.config, tied)
        qc.quantized, qc.modules_not_to_convert, qc.tied = (record["quantized"], record["modules_not_to_convert"],
                                                            record["tied"])
        qc.format_version, qc.torchqkit_version = record["format_version"], record["torchqkit_version"]
        return tensors, metadata

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


class _SharedQuantizerOp(ConversionOps):
    """transformers deep-copies a converter for every weight; its op must keep pointing at the one quantizer
    (which holds the checkpoint's headers and collects the report), not copy it."""

    def __init__(self, hf_quantizer: TorchqkitHfQuantizer):
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return type(self)(self.hf_quantizer)


class TorchqkitDeserialize(_SharedQuantizerOp):
    """One quantized weight's stored tensors ("weight:<inner>" -> [tensor]) to its AffineQuantizedTensor."""

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, model=None,
                **kwargs):
        ckpt = self.hf_quantizer.checkpoint
        if full_layer_name not in ckpt.weights:
            raise CheckpointError(f"{ckpt.path}: tensors {sorted(input_dict)} were loaded for {full_layer_name!r}, "
                                  f"which the torchqkit header does not describe")
        tensors = {}
        for pattern, values in input_dict.items():
            inner = pattern.partition(INNER_SEP)[2]
            values = values if isinstance(values, list) else [values]
            if len(values) != 1:
                raise CheckpointError(f"{ckpt.path}: {full_layer_name}{INNER_SEP}{inner}: {len(values)} tensors")
            tensors[inner] = values[0]
        weight = read_quantized_weight(ckpt, full_layer_name, tensors)
        module_name = full_layer_name.rpartition(".")[0]
        patch_extra_repr(model.get_submodule(module_name))
        return {full_layer_name: nn.Parameter(weight, requires_grad=False)}


class TorchqkitQuantize(_SharedQuantizerOp):
    """One float Linear weight, as transformers reads it, to its quantized weight (or left float, and reported)."""

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        value = next(iter(input_dict.values()))
        value = value[0] if isinstance(value, list) else value
        module_name = full_layer_name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        entry, weight = quantize_layer(module_name, module, self.hf_quantizer.configs, weight=value)
        self.hf_quantizer.loaded[module_name] = entry
        if weight is None:
            return {full_layer_name: value}
        patch_extra_repr(module)
        return {full_layer_name: nn.Parameter(weight, requires_grad=False)}


def register_with_transformers() -> None:
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(TorchqkitConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(TorchqkitHfQuantizer)


def adopt_quantized_model(model, config) -> None:
    """After ``quantize_`` on a transformers model: torchqkit becomes the model's quantizer, so that transformers'
    ``save_pretrained`` writes a torchqkit checkpoint however the model was loaded (api/after_quantize.py).

    A model without a quantizer (loaded in float) or with transformers' GGUF one (which dequantized every weight
    while loading: nothing of it is left) gets a TorchqkitHfQuantizer recording ``config``. One torchqkit already
    serves keeps its record; a second ``quantize_`` with another config leaves no single producing config, so the
    record's config becomes None (each weight's format is in its own header entry). Another method's quantizer
    still owns weights torchqkit can't save, so it stays, with a warning."""
    from transformers import PreTrainedModel
    if not isinstance(model, PreTrainedModel) or not any(
            isinstance(p, AffineQuantizedTensor) for p in model.parameters()):
        return
    current = getattr(model, "hf_quantizer", None)
    if isinstance(current, TorchqkitHfQuantizer):
        qc = current.quantization_config
        if qc.config is not None and encode_config(qc.config) != encode_config(config):
            qc.config = None
        return
    method = getattr(getattr(current, "quantization_config", None), "quant_method", None)
    if current is not None and getattr(method, "value", method) != "gguf":
        warnings.warn(f"torchqkit.quantize_: this model was loaded with transformers' {method} quantization, "
                      f"which still owns its weights; model.save_pretrained keeps using it and won't write "
                      f"torchqkit's weights. Quantize a float (or GGUF-loaded) model instead", stacklevel=3)
        return
    qc = TorchqkitConfig(config)
    model.hf_quantizer = TorchqkitHfQuantizer(qc, pre_quantized=True)
    model.quantization_method = QUANT_METHOD
    model.config.quantization_config = qc
    for m in model.modules():  # what transformers' own postprocess_model marks
        if isinstance(m, PreTrainedModel):
            m.config._is_quantized = True


register_after_quantize(adopt_quantized_model)


def _keep_expert_stacks_whole(model) -> None:
    """transformers' save_pretrained reverts its load-time conversions, and for MoE models one of them splits each
    fused 3-d expert Parameter back into per-expert tensors (``experts.gate_up_proj`` -> ``experts.0.gate_proj.weight``,
    ...). On a quantized stack that would cut its packed inner tensors (``gate_up_proj:qdata``) apart under names the
    torchqkit header doesn't describe; the stack is saved whole, as the header says, so those converters go."""
    stacks = [n for n, p in model.named_parameters() if isinstance(p, AffineQuantizedTensor) and p.dim() == 3]
    if not stacks:
        return
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # a model not loaded by from_pretrained: transformers would use its built-in mapping
        from transformers.conversion_mapping import get_model_conversion_mapping
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    model._weight_conversions = [c for c in conversions if not (isinstance(c, WeightConverter) and any(
        re.search(t, name) for t in c.target_patterns for name in stacks))]


def _open_checkpoint_of(checkpoint_files):
    """The torchqkit checkpoint behind the files transformers resolved: one file, or the shards of an index."""
    if not checkpoint_files:
        raise CheckpointError("torchqkit: transformers found no checkpoint file to load (a torchqkit checkpoint is "
                              "model.safetensors, or shards and model.safetensors.index.json)")
    files = [Path(f) for f in checkpoint_files]
    if any(f.suffix != ".safetensors" for f in files):
        raise CheckpointError(f"{files[0]}: torchqkit checkpoints are safetensors files; this is not one")
    if len(files) == 1:
        return open_checkpoint(files[0])
    index = files[0].parent / "model.safetensors.index.json"
    if not index.exists():
        raise CheckpointError(f"{files[0].parent}: {len(files)} shards but no model.safetensors.index.json")
    return open_checkpoint(index)


def _check_config_json(directory: Path) -> None:
    """The checkpoint's config.json, parsed strictly and its quantization_config checked, with its path in any error
    (transformers parsed it already, leniently: Note [One validation for both loaders], hf.py)."""
    if not (directory / "config.json").exists():
        return  # the config came from elsewhere (from_pretrained(config=...)); from_dict checked it
    qc = read_config_json(directory).get("quantization_config")
    if qc is not None:
        check_quantization_config(qc, f"{directory / 'config.json'}: quantization_config")


def _check_loaded(ckpt, model: nn.Module) -> None:
    """transformers logs a conversion that failed and goes on; a quantized weight left out is an error here."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in ckpt.weights if not isinstance(params.get(n), AffineQuantizedTensor)]
    if missing:
        raise CheckpointError(f"{ckpt.path}: quantized weight(s) {missing[:5]} were not loaded (see the load report "
                              f"above for the reason); the model would have run with initialised weights")


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return set(tied) | set(tied.values())


register_with_transformers()
