"""Layouts: one file each. Importing this package registers them all, and their routes with kernels.status()."""
from ..kernels import register_status_rows
from .base import Layout, PlainParts, WeightFormat, all_layouts, layout_class, register_layout
from .float8 import Float8Layout
from .fp6 import FP6Layout
from .mx import MXLayout
from .nf4 import NF4Layout
from .nm_sparse import NMSparseLayout
from .nvfp4 import NVFP4Layout
from .packed_intx import PackedIntxLayout
from .plain import PlainLayout
from .routes import Route, route_rows
from .tensor_core_tiled import TensorCoreTiledLayout

register_status_rows(lambda: [row for layout in all_layouts() for row in route_rows(layout)])
