"""The spec the four translations share: the contract and its errors, the LeNet and d2l's ResNet-18 with their
initial weights, memory layouts, shard arithmetic, batch order, data sets and device placement. The framework
folders import only this package; the machinery that runs and measures them is harness/. Importing it is cheap: no
deep-learning framework is imported here."""
from .interface import CONTRACT, FRAMEWORKS, RosettaError, Unavailable

__all__ = ["CONTRACT", "FRAMEWORKS", "RosettaError", "Unavailable"]
