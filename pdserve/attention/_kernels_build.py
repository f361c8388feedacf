"""cffi (API mode) builder for the CPU paged-attention kernel in csrc/paged_attention.c.

setup.py lists ``"pdserve/attention/_kernels_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.attention._cpu_kernels``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/attention/_kernels_build.py

Flags: ``-O3`` always; ``-march=native`` (the module is built on the machine that runs it) and
``-fopenmp`` each only when the compiler accepts them (probed with a tiny compile), so a compiler
without them still yields a working, slower module. ``PDSERVE_KERNEL_CFLAGS`` appends flags
(development only, e.g. ``-DPA_PROFILE`` to keep the stages out of line for perf). No
``-ffast-math``: the kernel relies on
-inf for masking.
"""

import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile

from cffi import FFI

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")

_CDEF = """
#define PA_OK 0
#define PA_ERR_SHAPE 1
#define PA_ERR_QUERY_START 2
#define PA_ERR_CONTEXT_LEN 3
#define PA_ERR_PAGE_ID 4
#define PA_ERR_ALLOC 5
#define PA_ERR_WINDOW 6

int pa_forward(void *out, const void *q, const void *k_pool, const void *v_pool,
               const int32_t *block_tables, const int32_t *query_start,
               const int32_t *context_lens, int num_tokens, int num_seqs, int max_pages,
               int num_pages, int hq, int hkv, int page_size, int head_dim, float scale,
               int window, int is_bf16, int num_threads, int64_t *err_info);
int pa_has_openmp(void);
"""


def _compiler() -> str:
    """The C compiler setuptools will use (first word of sysconfig CC, else 'cc')."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return cc.split()[0]


def _accepts(flags: list[str], source: str = "int main(void) { return 0; }\n") -> bool:
    """Whether the compiler compiles and links a tiny program with ``flags``."""
    cc = _compiler()
    if shutil.which(cc) is None:
        logger.warning("compiler %r not found while probing flags %s", cc, flags)
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(source)
        cmd = [cc, *flags, src, "-o", os.path.join(tmp, "probe")]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        logger.warning("compiler rejects %s: %s", flags, result.stderr.strip()[:300])
    return result.returncode == 0


def _flags() -> tuple[list[str], list[str]]:
    """(extra_compile_args, extra_link_args) for this machine."""
    compile_args = ["-O3", "-std=gnu11"]
    link_args: list[str] = []
    if _accepts(["-march=native"]):
        compile_args.append("-march=native")
    omp_probe = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    if _accepts(["-fopenmp"], omp_probe):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    compile_args += os.environ.get("PDSERVE_KERNEL_CFLAGS", "").split()
    return compile_args, link_args


def _make_builder() -> FFI:
    with open(os.path.join(_CSRC, "paged_attention.c")) as f:
        source = f.read()
    compile_args, link_args = _flags()
    builder = FFI()
    builder.cdef(_CDEF)
    builder.set_source(
        "pdserve.attention._cpu_kernels",
        source,
        include_dirs=[_CSRC],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    return builder


ffibuilder = _make_builder()

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    # Compile next to this file: pdserve/attention/_cpu_kernels.*.so (tmpdir = repo root).
    repo_root = os.path.dirname(os.path.dirname(_HERE))
    path = ffibuilder.compile(tmpdir=repo_root, verbose=True)
    logger.info("built %s", path)
