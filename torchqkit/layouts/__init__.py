"""Layouts: one file each. Importing this package registers them all."""
from .base import Layout, PlainParts, all_layouts, layout_class, register_layout
from .plain import PlainLayout
