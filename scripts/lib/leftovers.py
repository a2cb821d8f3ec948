#!/usr/bin/env python3
"""Usage: leftovers.py MARKER

Fails, naming them, if processes started under OUTBOXD_TEST_RUN=MARKER
(servers, brokers, daemons and examples the tests started: every child
inherits the variable, also through runuser) are still running. The
harness's watchdogs stop servers a moment after their test process ends,
so this waits up to 30 s before it names what is left, kills it, and fails.
"""

import os
import signal
import sys
import time


def left(marker):
    want = f"OUTBOXD_TEST_RUN={marker}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def main():
    marker = sys.argv[1]
    deadline = time.monotonic() + 30
    while True:
        pids = left(marker)
        if not pids:
            print("leftover processes: none")
            return 0
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    print("leftover processes: the run left these running (killed now):", file=sys.stderr)
    for pid in pids:
        print(f"  {pid}: {cmdline(pid)}", file=sys.stderr)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return 1


if __name__ == "__main__":
    sys.exit(main())
