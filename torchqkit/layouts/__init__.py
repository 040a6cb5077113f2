"""Layouts: one file each. Importing this package registers them all."""
from .base import Layout, PlainParts, all_layouts, layout_class, register_layout
from .float8 import Float8Layout
from .mx import MXLayout
from .nf4 import NF4Layout
from .plain import PlainLayout
