#!/usr/bin/env python3
"""Runs `cargo test` with each test's duration, and keeps the durations.

    timed-tests.py TIMES_FILE [cargo test arguments] [-- test arguments]

Builds the test binaries with `cargo test --no-run`, then runs each one
itself from its package's directory (as cargo does), with libtest's
`--report-time`, so every test line ends in its duration. The
`RUSTC_BOOTSTRAP` that unlocks that option is set for the test binaries
only: set for cargo, it would change the build and rebuild every crate.
Doctests run through `cargo test --doc` when the selection includes them.
Appends "seconds<TAB>binary<TAB>test" lines to TIMES_FILE; exits non-zero
when a binary fails (after running the others).
"""

import json
import os
import re
import subprocess
import sys


def main():
    times_file, args = sys.argv[1], sys.argv[2:]
    if "--" in args:
        split = args.index("--")
        cargo_args, test_args = args[:split], args[split + 1 :]
    else:
        cargo_args, test_args = args, []
    build = subprocess.run(
        ["cargo", "test", "--no-run", "--message-format=json-render-diagnostics", *cargo_args],
        stdout=subprocess.PIPE,
        text=True,
    )
    if build.returncode != 0:
        return build.returncode
    binaries = []
    for line in build.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["profile"]["test"]:
            binaries.append((msg["target"]["name"], msg["executable"], os.path.dirname(msg["manifest_path"])))
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    status = 0
    line_re = re.compile(r"^test (\S+) \.\.\. \w+.*<(\d+\.\d+)s>")
    with open(times_file, "a") as times:
        for name, exe, cwd in binaries:
            print(f"     Running {os.path.relpath(exe)} ({name})", flush=True)
            proc = subprocess.Popen(
                [exe, "-Z", "unstable-options", "--report-time", *test_args],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for out in proc.stdout:
                sys.stdout.write(out)
                sys.stdout.flush()
                m = line_re.match(out)
                if m:
                    times.write(f"{m.group(2)}\t{name}\t{m.group(1)}\n")
            if proc.wait() != 0:
                status = 1
    if not any(a in ("--test", "--bin", "--lib", "--bins", "--tests", "--benches", "--examples", "--example", "--bench") for a in cargo_args):
        doc = subprocess.run(["cargo", "test", "--doc", *cargo_args, "--", *test_args])
        if doc.returncode != 0:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
