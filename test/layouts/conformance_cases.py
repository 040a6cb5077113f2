"""Example quantizations for every registered layout, used by the shared conformance suite.

Every layout in torchqkit.layouts.all_layouts() must have an entry here: test_every_layout_enrolled
fails otherwise, so a new layout can't escape the suite. A case is (id, shape, quantize_weight kwargs).
"""
from __future__ import annotations

import torchqkit as qk
from torchqkit.core import qdtypes as Q

CASES: dict[str, list[tuple[str, tuple[int, int], dict]]] = {
    "plain": [
        ("int8-row", (48, 64), dict(qdtype=Q.int8, granularity=qk.PerRow())),
        ("uint4-g32-floatzp", (48, 96), dict(qdtype=Q.uint4, granularity=qk.PerGroup(32),
                                             mapping=qk.MappingType.ASYMMETRIC,
                                             zero_point_domain=qk.ZeroPointDomain.FLOAT)),
        ("int3-g16-asym", (40, 64), dict(qdtype=Q.int3, granularity=qk.PerGroup(16),
                                         mapping=qk.MappingType.ASYMMETRIC)),
        ("fp8e4m3-row", (48, 64), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerRow())),
        ("int8-row-dynact", (48, 64), dict(qdtype=Q.int8, granularity=qk.PerRow(),
                                           act_quant=qk.ActivationQuantSpec(Q.int8, qk.PerToken()))),
    ],
}


def all_cases():
    """(layout_name, case_id, shape, kwargs) for every registered layout's examples."""
    from torchqkit.layouts import all_layouts
    out = []
    for layout_cls in all_layouts():
        for case_id, shape, kwargs in CASES.get(layout_cls.name, []):
            out.append((layout_cls, case_id, shape, kwargs))
    return out
