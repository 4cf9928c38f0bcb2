"""jax_efc: GEMMs with fused, user-written epilogues for JAX.

    import jax_efc as efc
    y = efc.fused_dense(x, kernel, bias, activation="gelu")
    out = efc.gemm(a, b, lambda acc, c, *, alpha, beta: acc * alpha + c * beta, c, alpha=2.0, beta=1.0)
"""

from . import checkpoint_policies
from .activations import ACTIVATIONS
from .collective import all_gather_dense, dense_reduce_scatter
from .config import GemmConfig
from .device import set_target_arch
from .epilogue import EpilogueError
from .ffi import export_checks
from .fp8 import Fp8Meta, fp8_dense, fp8_mlp
from .gated import interleave_gated, split_gated
from .grouped import grouped_gemm
from .mlp import fused_mlp
from .ops import fused_dense, gemm
from .primitive import FallbackError, backends
from .ahead_of_time import warmup

__version__ = "0.1.0"
__all__ = ["gemm", "fused_dense", "fused_mlp", "GemmConfig", "ACTIVATIONS", "EpilogueError",
           "FallbackError", "backends", "checkpoint_policies", "set_target_arch", "export_checks", "warmup", "grouped_gemm",
           "fp8_dense", "fp8_mlp", "Fp8Meta", "interleave_gated", "split_gated", "all_gather_dense",
           "dense_reduce_scatter"]
