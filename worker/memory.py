"""What memory the process has and uses: the /proc readers (and CUDA's free memory) the KV sizing and
the dense weight copies read. A leaf module: it imports nothing from the worker."""
from __future__ import annotations

import os

import torch


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on device: CUDA's free bytes, a CPU's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current resident set (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def status_bytes(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")
