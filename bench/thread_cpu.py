#!/usr/bin/env python3
"""Per-thread CPU use of running processes, sampled from /proc (no perf needed).

    thread_cpu.py NAME [--delay S] [--seconds S] [--top N]

Waits --delay seconds, then reads every thread's utime+stime of each process whose
comm starts with NAME, again --seconds later, and prints the busiest threads (% of
one core over the window) grouped by process. Used to find which side of the gRPC
data plane saturates a core (bench/run_x2.sh).
"""
import argparse
import os
import time


def snapshot(name):
    out = {}
    hz = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().strip().startswith(name[:15]):
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(int(pid), int(tid))] = (comm, (int(fields[11]) + int(fields[12])) / hz)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    time.sleep(a.delay)
    s0 = snapshot(a.name)
    t0 = time.monotonic()
    time.sleep(a.seconds)
    s1 = snapshot(a.name)
    dt = time.monotonic() - t0
    by_pid = {}
    for key, (comm, cpu) in s1.items():
        if key in s0:
            by_pid.setdefault(key[0], []).append((100 * (cpu - s0[key][1]) / dt, comm, key[1]))
    if not by_pid:
        print(f"thread_cpu: no process named {a.name!r}")
    for pid, rows in sorted(by_pid.items()):
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"pid {pid}: {len(rows)} threads, {total:.0f}% of a core in all over {dt:.1f} s")
        for pct, comm, tid in rows[: a.top]:
            if pct >= 1:
                print(f"  {pct:5.0f}%  {comm} (tid {tid})")


if __name__ == "__main__":
    main()
