"""Algorithms: how qparams (and codes) are chosen.

``rtn`` is round-to-nearest on min-max / absmax ranges, the oracle's ``choose_qparams_affine`` itself;
``hqq`` (hqq.py) optimises the zero point of those ranges without calibration data. With calibration data:
``gptq`` (codes), ``awq`` and ``smoothquant`` (per-channel scales), ``observers`` (input statistics, static
ranges) and ``blockwise`` (the runner that feeds them one decoder block at a time); torchqkit/api/calibrate.py
puts them together for quantize_.
"""
from .hqq import hqq_qparams

__all__ = ["QPARAMS_ALGORITHMS", "check_algorithm", "hqq_qparams"]

QPARAMS_ALGORITHMS = ("rtn", "hqq")


def check_algorithm(who: str, algorithm) -> None:
    if algorithm not in QPARAMS_ALGORITHMS:
        raise ValueError(f"{who}: algorithm must be one of {QPARAMS_ALGORITHMS}, got {algorithm!r}")
