"""One rank of ``test_regressions.py``'s torchrun check (run by torchrun, not by pytest).

Runs the demo exactly as ``python -m rlobjectives.demo`` does, then prints how many Gloo threads
(``pt_gloo_runloop`` workers, ``gloo_tcp_loop``) are still alive: zero once the demo destroyed
its process group. A live worker at interpreter shutdown is what aborted one run in four.
"""

from __future__ import annotations

import os
import sys

from rlobjectives.demo import main


def gloo_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as handle:
            names.append(handle.read().strip())
    return sum("gloo" in name for name in names)


if __name__ == "__main__":
    status = main(sys.argv[1:])
    print(f"rank {os.environ.get('RANK')}: status {status}, gloo threads {gloo_threads()}")
    sys.exit(status)
