"""Facts about the machine a benchmark ran on: memory bandwidth and versions.

Decoding a small language model on a CPU is bound by memory bandwidth (every
token streams all weights once), so results are reported next to a STREAM-like
copy measurement.

``measure_memory_bandwidth()`` times ``numpy.copyto`` between two arrays much
larger than the last-level cache and counts read + write bytes (2 x size per
copy), best of several repeats. numpy's copy runs on a single thread, so the
plain figure is single-core bandwidth; with ``threads=(1, 2)`` the copy is also
run with the arrays split into one chunk per thread, each chunk copied by its
own Python thread (numpy releases the GIL during the copy), which shows how far
more cores raise the attainable bandwidth.

``python -m bench.machine`` prints both as JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import threading
import time
from typing import Any, Sequence

MIB = 1 << 20


def _best_copy_seconds(src, dst, repeats: int, threads: int) -> float:
    import numpy as np

    if threads <= 1:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        return best

    n = src.shape[0]
    bounds = [(i * n) // threads for i in range(threads + 1)]
    chunks = [(src[bounds[i]:bounds[i + 1]], dst[bounds[i]:bounds[i + 1]]) for i in range(threads)]
    best = float("inf")
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)
        done = threading.Barrier(threads + 1)

        def work(s, d):
            barrier.wait()
            np.copyto(d, s)
            done.wait()

        workers = [threading.Thread(target=work, args=c) for c in chunks]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        done.wait()
        elapsed = time.perf_counter() - t0
        for w in workers:
            w.join()
        best = min(best, elapsed)
    return best


def measure_memory_bandwidth(size_mib: int = 256, repeats: int = 7,
                             threads: Sequence[int] | None = None) -> dict[str, Any]:
    """STREAM-like copy bandwidth in GB/s (1e9 bytes/s, read + write counted).

    Returns ``{"copy_gb_s": best, "size_mib", "repeats", "method",
    "per_threads": {"1": GB/s, "2": GB/s} (only when ``threads`` is given)}``.
    The first copy (page faults) is excluded by a warm-up pass.
    """
    import numpy as np

    n = size_mib * MIB // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up: fault in every page of both arrays
    moved = 2 * src.nbytes  # read src + write dst

    secs = _best_copy_seconds(src, dst, repeats, 1)
    result: dict[str, Any] = {
        "copy_gb_s": round(moved / secs / 1e9, 2),
        "size_mib": size_mib,
        "repeats": repeats,
        "method": "numpy.copyto float64, best of repeats, bytes = read + write",
        "numpy_threads": 1,
    }
    if threads:
        per: dict[str, float] = {}
        for t in threads:
            s = _best_copy_seconds(src, dst, repeats, int(t))
            per[str(int(t))] = round(moved / s / 1e9, 2)
        result["per_threads"] = per
        result["per_threads_method"] = "array split in equal chunks, one Python thread per chunk"
    del src, dst
    return result


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            import subprocess

            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5)
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cpu_counts() -> dict[str, Any]:
    logical = os.cpu_count()
    physical = None
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except Exception:
        pass
    usable = None
    if hasattr(os, "sched_getaffinity"):
        try:
            usable = len(os.sched_getaffinity(0))
        except OSError:
            pass
    return {"logical": logical, "physical": physical, "usable": usable}


def _dist_version(dist: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(dist)
    except PackageNotFoundError:
        return None
    except Exception:
        return None


def machine_info(include_bandwidth: bool = False) -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python and package versions, date (UTC).

    Package versions come from installed distribution metadata, so the peers are
    not imported (importing them is slow and may fail); ``None`` = not installed.
    """
    mem = _memory_bytes()
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": _cpu_counts(),
        "memory_gib": round(mem / (1 << 30), 2) if mem else None,
        "os": platform.platform(),
        "machine": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "versions": {
            name: _dist_version(name)
            for name in ("numpy", "onnxruntime", "onnxruntime-gpu", "tokenizers",
                         "onnxruntime-genai", "onnx-genai", "ortspec")
        },
    }
    if include_bandwidth:
        info["memory_bandwidth"] = measure_memory_bandwidth(threads=(1, 2))
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print machine facts as JSON.")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the copy benchmark")
    ap.add_argument("--size-mib", type=int, default=256)
    args = ap.parse_args(argv)
    info = machine_info()
    if not args.no_bandwidth:
        info["memory_bandwidth"] = measure_memory_bandwidth(args.size_mib, threads=(1, 2))
    json.dump(info, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
