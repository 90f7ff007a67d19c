"""flashoverlap: hide tensor-parallel communication behind the GEMM that produces it."""

from . import logs  # noqa: F401  (its default handler: messages seen without any logging setup)
from .config import OverlapConfig
from .integrations.hf import patch
from .overlap import gemm_all_reduce, gemm_all_to_all, gemm_reduce_scatter, with_gradients
from .plan import Plan, make_plan

__all__ = [
    "OverlapConfig",
    "Plan",
    "gemm_all_reduce",
    "gemm_all_to_all",
    "gemm_reduce_scatter",
    "make_plan",
    "patch",
    "with_gradients",
]
__version__ = "0.1.0"
