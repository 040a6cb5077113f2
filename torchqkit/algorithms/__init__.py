"""Algorithms: how qparams (and codes) are chosen.

``rtn`` is round-to-nearest on min-max / absmax ranges, the oracle's ``choose_qparams_affine`` itself;
``hqq`` (hqq.py) optimises the zero point of those ranges without calibration data.
"""
from .hqq import hqq_qparams

__all__ = ["QPARAMS_ALGORITHMS", "check_algorithm", "hqq_qparams"]

QPARAMS_ALGORITHMS = ("rtn", "hqq")


def check_algorithm(who: str, algorithm) -> None:
    if algorithm not in QPARAMS_ALGORITHMS:
        raise ValueError(f"{who}: algorithm must be one of {QPARAMS_ALGORITHMS}, got {algorithm!r}")
