"""C compiler flags for the cffi kernel modules (attention, small linear), probed on this machine.

Loaded by path from the builders (`pdserve/kernels/attention/_kernels_build.py`,
`pdserve/kernels/ops/_ops_build.py`), which setuptools runs as plain files before the package is
importable, so this module imports nothing from pdserve.

Flags: ``-O3 -std=gnu11`` always; ``-march=native`` (a module is built on the machine that runs
it) and ``-fopenmp`` each only when the compiler accepts them (probed with a tiny compile), so a
compiler without them still yields a working, slower module. ``PDSERVE_KERNEL_CFLAGS`` appends
flags (development only). No ``-ffast-math``: the attention kernel relies on -inf for masking and
the linear kernel on a fixed summation order.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile

logger = logging.getLogger(__name__)


def compiler() -> str:
    """The C compiler setuptools will use (first word of sysconfig CC, else 'cc')."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return cc.split()[0]


def accepts(flags: list[str], source: str = "int main(void) { return 0; }\n") -> bool:
    """Whether the compiler compiles and links a tiny program with ``flags``."""
    cc = compiler()
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


def flags() -> tuple[list[str], list[str]]:
    """(extra_compile_args, extra_link_args) for this machine."""
    compile_args = ["-O3", "-std=gnu11"]
    link_args: list[str] = []
    if accepts(["-march=native"]):
        compile_args.append("-march=native")
    omp_probe = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    if accepts(["-fopenmp"], omp_probe):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    compile_args += os.environ.get("PDSERVE_KERNEL_CFLAGS", "").split()
    return compile_args, link_args

