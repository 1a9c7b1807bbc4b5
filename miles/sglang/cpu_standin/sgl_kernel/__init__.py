"""A stand-in for SGLang's kernel package (`sgl_kernel`) on machines without a GPU.

SGLang 0.5.23 imports `sgl_kernel` even with SGLANG_USE_CPU_ENGINE=1
(sglang/kernels/ops/kvcache/cache_move.py imports copy_all_layer_kv_cache_cpu at module level), and
the registry has no CPU build of the package: `sglang-kernel` 0.4.10 and `sgl-kernel` 0.3.21 are
CUDA-only (ImportError: libcuda.so.1) and hold none of the CPU ops. On the CPU path SGLang calls
none of them: it logs that its CPU thread binding is disabled and computes with PyTorch.

So this module satisfies the imports and nothing else: every attribute is a function that raises
KernelUnavailable when called, so a code path that does need a kernel fails naming it instead of
computing something else. It has no submodules: `from sgl_kernel.scalar_type import ...` raises
ImportError, which is what SGLang's fallbacks (its own Python versions of those modules) expect. miles puts
the directory above this one on the PYTHONPATH of the SGLang servers it launches on the CPU only
(miles/sglang/server.py); on a GPU the real kernel package is used.
Non-goal: implementing any kernel.
"""

from __future__ import annotations

import sys
import types

STANDIN = True  # how a caller tells this package from the real one


class KernelUnavailable(RuntimeError):
    """A kernel of SGLang's kernel package was called on a machine that only has miles' CPU stand-in."""


def _unavailable(qualname: str):
    def kernel(*args, **kwargs):
        raise KernelUnavailable(
            f"{qualname} was called, but this SGLang runs with miles' CPU stand-in for sgl_kernel, which has no "
            "kernels: run SGLang on a GPU with the real kernel package (pip install sglang), or pick SGLang flags "
            "whose CPU path needs no kernel (--device cpu --attention-backend torch_native)")

    kernel.__name__ = kernel.__qualname__ = qualname.rsplit(".", 1)[-1]
    return kernel


class _StandinModule(types.ModuleType):
    """A module whose every public attribute is a kernel that raises when called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # __path__, __version__, ...: what import machinery and callers probe for
            raise AttributeError(name)
        return _unavailable(f"{self.__name__}.{name}")


sys.modules[__name__].__class__ = _StandinModule
