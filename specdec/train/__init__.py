"""Making and training drafters (layer-truncated draft models; learned heads come later)."""
