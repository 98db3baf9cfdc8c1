"""Structured outputs: JSON schema, regex, choice and grammar constraints applied as token masks."""

from tokenmill.structured_output.manager import StructuredOutputManager, StructuredOutputRequest
from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "StructuredOutputsParams"]
