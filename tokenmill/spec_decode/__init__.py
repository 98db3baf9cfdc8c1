"""Speculative decoding: proposers guess the next tokens, one target step verifies them all at once."""

from tokenmill.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
