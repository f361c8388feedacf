"""Build hook: compiles the cffi extensions at install time.

- fabric/_ffi_build.py: libfabric bindings (needs libfabric-dev, see scripts/setup.sh)
- fabric/_ucx_build.py: the UCX core of fabric.ucx (UCX 1.22 from the libucx-cu12 wheel, a build
  requirement in pyproject.toml)
- pdserve/kernels/attention/_kernels_build.py: the C paged-attention kernel (OpenMP)
- pdserve/kernels/ops/_ops_build.py: C CPU ops (small-batch linear, fused RMSNorm / SiLU-mul / argmax)
- kv_messenger/_checksum_build.py: the page-shard checksum (CRC32C, S7)

Each builder reads its module's cdef from the module's C header and its compiler flags from
native_build.py (repository root, loaded by path: setuptools runs the builders before any
package here is importable).
"""

from setuptools import setup

setup(
    cffi_modules=[
        "fabric/_ffi_build.py:ffibuilder",
        "fabric/_ucx_build.py:ffibuilder",
        "pdserve/kernels/attention/_kernels_build.py:ffibuilder",
        "pdserve/kernels/ops/_ops_build.py:ffibuilder",
        "kv_messenger/_checksum_build.py:ffibuilder",
    ]
)
