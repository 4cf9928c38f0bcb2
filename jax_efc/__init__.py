"""jax_efc: GEMMs with fused, user-written epilogues for JAX.

    import jax_efc as efc
    y = efc.fused_dense(x, kernel, bias, activation="gelu")
    out = efc.gemm(a, b, lambda acc, c, *, alpha, beta: acc * alpha + c * beta, c, alpha=2.0, beta=1.0)
"""

import os as _os

# `ffi/` at the project root is installed as `jax_efc.ffi`; from a source checkout that is
# not installed, find it there.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "ffi")) and _os.path.isfile(
    _os.path.join(_root, "ffi", "__init__.py")
):
    __path__.append(_root)

from . import checkpoint_policies  # noqa: E402
from .activations import ACTIVATIONS  # noqa: E402
from .config import GemmConfig  # noqa: E402
from .epilogue import EpilogueError  # noqa: E402
from .mlp import fused_mlp  # noqa: E402
from .ops import fused_dense, gemm  # noqa: E402
from .primitive import FallbackError, backends  # noqa: E402

__version__ = "0.1.0"
__all__ = ["gemm", "fused_dense", "fused_mlp", "GemmConfig", "ACTIVATIONS", "EpilogueError",
           "FallbackError", "backends", "checkpoint_policies"]
