"""Foreshock client: streams samples of model internals to foreshockd.

Public API: Monitor, ModelInfo (see README.md next to this package).
"""
from foreshock.capture import ModelInfo
from foreshock.monitor import Monitor

__all__ = ["Monitor", "ModelInfo"]
__version__ = "0.1.0"
