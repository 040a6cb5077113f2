"""``python -m torchqkit export``: a quantized checkpoint written in another tool's format."""
