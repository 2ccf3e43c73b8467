"""Sums a profile's device time per op: `python bench/trace_ops.py A.json.gz [B.json.gz]` (perfetto traces that
`jax.profiler.trace(..., create_perfetto_trace=True)` wrote; bench/tpu_gather.py --profile). With two traces, the
ops side by side, largest difference first: where one program's extra time goes.

Device events are those of processes whose name holds "TPU" (or, with none, every non-Python event: a CPU trace);
an op's name is the event's name with a trailing ".N" clone suffix kept (fusions keep their own names)."""

from __future__ import annotations

import collections
import gzip
import json
import sys


def op_times(path: str) -> tuple[dict[str, float], int]:
    """{op name: total microseconds} over the trace's device events, and how many device events there were."""
    events = json.load(gzip.open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if "TPU" in n and "Host" not in n}
    total, count = collections.Counter(), 0
    for e in events:
        if e.get("ph") != "X" or (device and e["pid"] not in device) or (not device and e["name"].startswith("$")):
            continue
        total[e["name"]] += float(e.get("dur", 0.0))
        count += 1
    return dict(total), count


def main(argv=None) -> None:
    paths = (argv or sys.argv[1:])[:2]
    times = [op_times(p) for p in paths]
    for p, (t, n) in zip(paths, times, strict=True):
        print(f"{p}: {n} device events, {sum(t.values()) / 1e3:.2f} ms in all")
    if len(times) == 1:
        for name, us in sorted(times[0][0].items(), key=lambda kv: -kv[1])[:40]:
            print(f"{us / 1e3:9.3f} ms  {name}")
        return
    a, b = times[0][0], times[1][0]
    rows = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))
    print(f"{'A ms':>9} {'B ms':>9} {'B-A ms':>9}  op")
    for name in rows[:40]:
        x, y = a.get(name, 0.0) / 1e3, b.get(name, 0.0) / 1e3
        print(f"{x:9.3f} {y:9.3f} {y - x:9.3f}  {name}")


if __name__ == "__main__":
    main()
