"""The server under test in ``bench.serve_load``: ``ortspec serve`` as a subprocess on a free loopback port
(``ServerProcess``), with what its processes use read from /proc (CPU seconds, resident memory and its peak) and
its ``/metrics`` samples; ``contended`` runs a phase and says how many cores the server, the clients and every other
process used meanwhile."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from bench.machine import CpuContention

T = TypeVar("T")
MODEL_NAME = "served"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------------------------


class ServerProcess:
    """``ortspec serve`` in a subprocess on a free loopback port, started with ``config_args`` (a configuration's
    CLI arguments) and ``max_queue``; ``url`` answers once ``wait_ready`` returns."""

    def __init__(self, model_dir: Path, config_args: Sequence[str], max_queue: int, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ortspec.adapters.cli", "serve", "--model", str(model_dir)]
        cmd += ["--model-name", MODEL_NAME, "--port", str(self.port), *config_args]
        cmd += ["--max-queue", str(max_queue), "--log-level", "warning"]
        self.command = cmd
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout_s} s")

    def processes(self) -> list[int]:
        """The server process and every process under it (``--ray``: the local Ray instance and its replicas)."""
        parents: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(stat.parent.name))
        tree, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += parents.get(pid, [])
        return tree

    def cpu_seconds(self) -> float:
        """CPU time the server's processes have used (user + system, their threads included)."""
        total = 0
        for pid in self.processes():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def memory_mib(self) -> dict[str, float | None]:
        """The server's processes' resident memory now (``rss``: VmRSS) and their peaks (``peak``: VmHWM, since start
        or since the last ``reset_peak``), summed, MiB; None where /proc does not say."""
        kib: dict[str, int] = {}
        for pid in self.processes():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(("VmRSS", "VmHWM")):
                        kib[line.split(":")[0]] = kib.get(line.split(":")[0], 0) + int(line.split()[1])
        return {k: round(kib[v] / 1024, 1) if v in kib else None for k, v in (("rss", "VmRSS"), ("peak", "VmHWM"))}

    def reset_peak(self) -> bool:
        """Reset the server's processes' VmHWM to their current RSS (Linux: ``5`` to ``/proc/PID/clear_refs``);
        False if the kernel refused (the peak is then the server's lifetime peak)."""
        try:
            for pid in self.processes():
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    def metrics(self) -> dict[str, float]:
        """The server's ``ortspec_`` samples, summed over labels (``name_total`` / ``name_sum`` / ``name_count``
        -> value; histogram buckets and creation times left out)."""
        totals: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if not line.startswith("ortspec_"):
                continue
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            if not name.endswith(("_bucket", "_created")):
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def contended(server: ServerProcess, phase: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """Run ``phase`` and say how many cores the server, this process (the clients) and every other process used
    on average meanwhile (other processes: load that does not belong to the benchmark), and the server's CPU
    seconds in it."""
    cpu0 = server.cpu_seconds()
    with CpuContention() as c:
        value = phase()
    server_s = server.cpu_seconds() - cpu0
    server_cores = server_s / c.wall_s if c.wall_s else 0.0
    others = None if c.others_cores is None else round(max(0.0, c.others_cores - server_cores), 2)
    cpu = {"server_cores": round(server_cores, 2), "client_cores": c.self_cores, "other_cores": others}
    return value, cpu | {"server_s": round(server_s, 1)}
