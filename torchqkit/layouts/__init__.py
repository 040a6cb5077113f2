"""Layouts: one file each. Importing this package registers them all."""
from .base import Layout, PlainParts, all_layouts, layout_class, register_layout
from .float8 import Float8Layout
from .mx import MXLayout
from .nf4 import NF4Layout
from .packed_intx import PackedIntxLayout
from .plain import PlainLayout
from .tensor_core_tiled import TensorCoreTiledLayout
