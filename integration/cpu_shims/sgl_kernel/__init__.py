"""CPU test shim standing in for ``sgl_kernel`` (TEST-ONLY, never shipped in the package).

Why it exists
-------------
SGLang 0.5.23 imports ``sgl_kernel`` (PyPI dist ``sglang-kernel``) in many modules. The PyPI
build is CUDA-only: ``import sgl_kernel`` fails on a machine without ``libcuda.so.1``.
On these CPU-only test machines (no AMX), SGLang runs with ``SGLANG_USE_CPU_ENGINE=1``
and ``--attention-backend torch_native`` and never *calls* an ``sgl_kernel`` op; it only
imports names. This package satisfies those imports.

How to use it
-------------
Put the *parent* directory first on ``PYTHONPATH`` so it shadows the installed CUDA build::

    PYTHONPATH=integration/cpu_shims SGLANG_USE_CPU_ENGINE=1 \
        python -m sglang.launch_server --device cpu --attention-backend torch_native ...

(``integration/sglang_server.py`` does this for tests.)

Behaviour
---------
* ``sgl_kernel.<anything>`` returns a stub. Stubs support further attribute access
  (``sgl_kernel.scalar_type.scalar_types.uint4b8``) and raise :class:`SglKernelShimError`
  with the dotted name when *called*, so an accidental use fails loudly, never silently.
* ``import sgl_kernel.<sub>[.<subsub>...]`` works for any submodule name (a meta-path
  finder creates stub modules on demand), e.g. ``sgl_kernel.kvcacheio``,
  ``sgl_kernel.flash_attn``, ``sgl_kernel.scalar_type``, ``sgl_kernel.quantization``.
* Stubs are falsy-safe for ``is None`` checks (they are not None) and ``hasattr`` is
  always True: code that probes for a kernel with ``hasattr`` will think it exists, and
  then fail loudly if it calls it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+cpushim"
IS_TENSORHUB_CPU_SHIM = True


class SglKernelShimError(RuntimeError):
    """Raised when code calls an ``sgl_kernel`` op through the CPU shim."""


class _Stub:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> _Stub:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise SglKernelShimError(
            f"{self._name}() was called, but sgl_kernel is the TensorHub CPU test shim "
            "(integration/cpu_shims). This code path needs the real CUDA/AMX kernel; "
            "run with --device cpu --attention-backend torch_native on a CPU without AMX."
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU shim stub {self._name}>"

    # Allow use as a base class / in type annotations evaluated at import time.
    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(modname: str):
    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{modname}.{attr}")

    return __getattr__


class _ShimSubmoduleLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # a package, so deeper submodules import too
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module) -> None:
        return None


class _ShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(
                fullname, _ShimSubmoduleLoader(), is_package=True
            )
        return None


if not any(isinstance(f, _ShimFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShimFinder())

__getattr__ = _module_getattr(__name__)
