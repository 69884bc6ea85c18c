"""The one error a model load raises for anything wrong with the files (never a raw torch/KeyError)."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """Names the file and, where it applies, the tensor and the expected vs actual shape."""
