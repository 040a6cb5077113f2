"""The torchqkit release (checkpoint headers record it); one definition, below every package."""
__version__ = "0.1.0"
