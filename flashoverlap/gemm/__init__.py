"""CUTLASS signal GEMMs: generated from Python, compiled with nvcc, cached on disk."""

from .generator import GemmSpec, generate, validate_instance
from .kernel import FusedSums, SignalGemm, get_kernel

__all__ = ["FusedSums", "GemmSpec", "SignalGemm", "generate", "get_kernel", "validate_instance"]
