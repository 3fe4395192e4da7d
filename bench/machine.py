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
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    chunks = [(src[bounds[i] : bounds[i + 1]], dst[bounds[i] : bounds[i + 1]]) for i in range(threads)]
    best = float("inf")

    def work(s, d, barrier: threading.Barrier, done: threading.Barrier) -> None:
        barrier.wait()
        np.copyto(d, s)
        done.wait()

    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)
        done = threading.Barrier(threads + 1)
        workers = [threading.Thread(target=work, args=(*c, barrier, done)) for c in chunks]
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


def measure_memory_bandwidth(
    size_mib: int = 256, repeats: int = 7, threads: Sequence[int] | None = None
) -> dict[str, Any]:
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


def _proc_stat_busy() -> tuple[float, float] | None:
    """(busy, total) CPU seconds over all cores since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [int(x) for x in fields[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already inside user/nice
    hz = os.sysconf("SC_CLK_TCK")
    return (total - idle) / hz, total / hz


def _self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuContention:
    """Context manager: how busy the machine was with *other* processes.

    ``with CpuContention() as c: ...`` then ``c.others_cores`` is the average
    number of cores used by other processes during the block (0 = quiet
    machine) and ``c.self_cores`` this process's average. Linux only (reads
    /proc/stat); elsewhere both are ``None``. Use it to flag benchmark runs
    disturbed by background load.
    """

    def __init__(self) -> None:
        self.others_cores: float | None = None
        self.self_cores: float | None = None
        self.wall_s = 0.0

    def __enter__(self) -> CpuContention:
        self._stat0 = _proc_stat_busy()
        self._self0 = _self_cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        stat1 = _proc_stat_busy()
        if self._stat0 is None or stat1 is None or self.wall_s <= 0:
            return
        busy = stat1[0] - self._stat0[0]
        mine = _self_cpu_seconds() - self._self0
        self.self_cores = round(mine / self.wall_s, 3)
        self.others_cores = round(max(0.0, busy - mine) / self.wall_s, 3)

    def as_dict(self) -> dict[str, Any]:
        return {"others_cores": self.others_cores, "self_cores": self.self_cores, "wall_s": round(self.wall_s, 3)}


def background_load(seconds: float = 1.0) -> float | None:
    """Average cores used by other processes over ``seconds`` of sleeping."""
    with CpuContention() as c:
        time.sleep(seconds)
    return c.others_cores


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

            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
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


def git_commit(short: bool = False) -> str | None:
    """The repository's ``HEAD`` commit (abbreviated with ``short``), what every results file records; None where
    git cannot tell (not a checkout, no git)."""
    command = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def machine_info(include_bandwidth: bool = False) -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python and package versions, date (UTC).

    Package versions come from installed distribution metadata, so the peers are
    not imported (importing them is slow and may fail); ``None`` = not installed.
    """
    mem = _memory_bytes()
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": _cpu_counts(),
        "memory_gib": round(mem / (1 << 30), 2) if mem else None,
        "os": platform.platform(),
        "machine": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "background_load_cores": background_load(0.5),
        "versions": {
            name: _dist_version(name)
            for name in (
                "numpy",
                "onnxruntime",
                "onnxruntime-gpu",
                "tokenizers",
                "onnxruntime-genai",
                "onnx-genai",
                "ortspec",
            )
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
