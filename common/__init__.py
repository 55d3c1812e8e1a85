"""Everything that is not framework-specific: the contract, data, the LeNet spec and its weights,
batching, timing and reporting. Importing it is cheap: no deep-learning framework is imported here."""
from .interface import CONTRACT, FRAMEWORKS, RosettaError, load_framework

__all__ = ["CONTRACT", "FRAMEWORKS", "RosettaError", "load_framework"]
