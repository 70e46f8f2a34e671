#!/usr/bin/env python3
"""Where the CPU of a sale's first moment goes (scripts/bench.sh, row 5c).

  first-moment.py MARKFILE MS NAME=PID...

Waits until the load generator writes its "buying" line into MARKFILE (its
stderr), then reads every thread of each process named, and of Redis,
Kafka and PostgreSQL (found by name), at that moment and MS milliseconds later, from
/proc/PID/task/*/schedstat (PostgreSQL: every backend): nanoseconds run on a CPU and nanoseconds spent
runnable on a run queue, waiting for one. Prints one line as JSON:

  {"ms": wall ms measured, "cpus": n, "run_ms": {name: ms}, "wait_ms": {name: ms},
   "kinds": {name: {thread kind: run ms}}}

The sum of run_ms against cpus x ms says how full the host was; a process
whose wait_ms is as large as its run_ms got about half of the CPU it
asked for. Unlike /proc/PID/stat's clock ticks (10 ms each), schedstat is
exact at this scale.
"""
import json
import os
import re
import sys
import time

BY_NAME = {"redis-server": "redis", "java": "kafka", "postgres": "postgres"}


def comm(path):
    try:
        with open(f"{path}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def threads(pid):
    """{tid: (kind, run ns, wait ns)} of a process's threads."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        path = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{path}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        # Thread names differ by a number only (rdk:broker1, worker-3).
        out[tid] = (re.sub(r"\d+", "#", comm(path)), int(run), int(wait))
    return out


def main(argv):
    mark, ms = argv[0], float(argv[1])
    pids = {int(pid): name for name, pid in (a.split("=", 1) for a in argv[2:])}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in pids:
            name = BY_NAME.get(comm(f"/proc/{entry}"))
            if name:
                pids[int(entry)] = name
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with open(mark) as f:
                if any(line.startswith("buying") for line in f):
                    break
        except OSError:
            pass
        time.sleep(0.002)
    else:
        sys.exit("no buying line in " + mark)
    before = {pid: threads(pid) for pid in pids}
    t0 = time.monotonic()
    time.sleep(ms / 1000)
    after = {pid: threads(pid) for pid in pids}
    wall = (time.monotonic() - t0) * 1000
    run, wait, kinds = {}, {}, {}
    for pid, name in pids.items():
        for tid, (kind, r, w) in after[pid].items():
            # A thread started inside the window counts from its start.
            _, r0, w0 = before[pid].get(tid, (kind, 0, 0))
            run[name] = run.get(name, 0) + (r - r0) / 1e6
            wait[name] = wait.get(name, 0) + (w - w0) / 1e6
            k = kinds.setdefault(name, {})
            k[kind] = k.get(kind, 0) + (r - r0) / 1e6
    rnd = lambda d: {k: round(v, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
    print(json.dumps({
        "ms": round(wall, 1),
        "cpus": os.cpu_count(),
        "run_ms": rnd(run),
        "wait_ms": rnd(wait),
        "kinds": {n: {k: v for k, v in rnd(k).items() if v >= 0.5} for n, k in kinds.items()},
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
