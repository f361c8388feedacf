"""The machine a benchmark ran on, read once from /proc and the runtime (the caller's thread)."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from typing import Any


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first `key:` line of a /proc file, or None where the file or line is missing."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def cpu_flags(prefixes: tuple[str, ...] = ("avx", "fma", "amx", "sse4_2")) -> str:
    """The CPU's vector flags that matter to the kernels, sorted, space separated."""
    flags = (_proc_field("/proc/cpuinfo", "flags") or "").split()
    return " ".join(sorted(f for f in flags if f.startswith(prefixes)))


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    nproc: int
    affinity_cpus: int
    mem_total_gib: float
    kernel: str
    python: str
    torch: str
    load_average: tuple[float, float, float]   # 1, 5, 15 min, when the stamp was taken

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for a results file's footer."""
        load = ", ".join(f"{x:.2f}" for x in self.load_average)
        return (f"{self.nproc} CPUs ({self.affinity_cpus} usable), {self.cpu_model}, {self.mem_total_gib} GiB, "
                f"Linux {self.kernel}, Python {self.python}, torch {self.torch}, load average {load}")


def machine() -> Machine:
    """This machine now (the load average is this moment's)."""
    mem_kib = (_proc_field("/proc/meminfo", "MemTotal") or "0 kB").split()[0]
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:   # the fabric benchmarks run without torch
        torch_version = "absent"
    return Machine(
        cpu_model=_proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        nproc=os.cpu_count() or 0,
        affinity_cpus=len(os.sched_getaffinity(0)),
        mem_total_gib=round(int(mem_kib) / 2**20, 1),
        kernel=platform.release(),
        python=platform.python_version(),
        torch=torch_version,
        load_average=tuple(round(x, 2) for x in os.getloadavg()),   # type: ignore[arg-type]
    )
