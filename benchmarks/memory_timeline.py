"""A command's resident set over time beside the lines it prints: where a run's peak memory comes from.

    python benchmarks/memory_timeline.py -- python -m jaxloop.train --preset shakespeare --steps 150 ...

Samples the child's VmRSS and VmHWM (/proc/PID/status) every 50 ms; prints a line each time the high-water mark
passes another 20 MiB, then the child's stderr lines with their times (seconds since the start).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time


def main(argv: list[str]) -> int:
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else argv
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            lines.append((time.monotonic() - t0, line.rstrip()[:110]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    last = -1
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/status") as f:
                status = f.read()
            rss = int(status.split("VmRSS:")[1].split()[0]) // 1024
            hwm = int(status.split("VmHWM:")[1].split()[0]) // 1024
        except (OSError, IndexError, ValueError):
            break
        if hwm // 20 != last:
            last = hwm // 20
            print(f"{time.monotonic() - t0:7.2f} s  rss {rss} MiB  peak {hwm} MiB")
        time.sleep(0.05)
    reader.join(timeout=5)
    for t, line in lines:
        print(f"{t:7.2f} s | {line}")
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
