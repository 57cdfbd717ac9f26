"""Is the GPU machine's host speed steady, and does the core a process runs on matter? (GPU machine)

    python3 scripts/host_state_probe.py [--seconds 20] [--model seedcnn:float32:1]

Host-bound cells (seedcnn at batch 1) flip between a fast and a slow state (about 1.7x, every part
of the host path together). This separates the machine from the process: it prints the CPU
topology and frequency facts, then times a fixed pure-Python workload (no torch) in blocks, with
the core each block ran on: unpinned over time, then pinned to each core in turn. With ``--model``
it then times the fxopt-compiled call (CUDA events, the benchmark's way) unpinned and pinned to
the fastest and the slowest core found.
"""
import argparse
import os
import statistics
import subprocess
import time

from fxopt.bench.runners import host_speed_us


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # facts are best effort
        return f"({e})"


def current_cpu() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def block_us(reps: int = 200) -> tuple:
    """(median µs of the benchmark's fixed Python workload, the core it ran on)."""
    return host_speed_us(reps), current_cpu()


def facts() -> None:
    print(sh("lscpu | egrep -i 'model name|^CPU\\(s\\)|thread|core|socket|numa|MHz|hypervisor'"))
    print("governor:", sh("cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null") or "n/a")
    mhz = [float(x) for x in sh("grep MHz /proc/cpuinfo | awk '{print $4}'").split()]
    if mhz:
        print(f"cpu MHz now: min {min(mhz):.0f} median {statistics.median(mhz):.0f} max {max(mhz):.0f}")
    print("loadavg:", sh("cat /proc/loadavg"))
    print("busiest processes:\n" + sh("ps -eo pcpu,psr,comm --sort=-pcpu | head -6"))
    print("siblings:", sh("cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | sort -u | tr '\\n' ' '"))


def drift(seconds: float) -> None:
    rows = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        rows.append(block_us())
        time.sleep(0.1)
    us = [u for u, _ in rows]
    print(f"unpinned, {len(rows)} blocks over {seconds:.0f} s: median {statistics.median(us):.2f} us "
          f"min {min(us):.2f} max {max(us):.2f}")
    by_cpu: dict = {}
    for u, c in rows:
        by_cpu.setdefault(c, []).append(u)
    print("  by core: " + ", ".join(f"{c}:{statistics.median(v):.2f}x{len(v)}" for c, v in sorted(by_cpu.items())))
    print("  sequence: " + " ".join(f"{u:.1f}@{c}" for u, c in rows[:: max(1, len(rows) // 40)]))


def per_core(cpus) -> dict:
    speed = {}
    for c in cpus:
        os.sched_setaffinity(0, {c})
        block_us(50)
        speed[c] = min(block_us()[0] for _ in range(3))
    print("pinned per core (us): " + ", ".join(f"{c}:{u:.2f}" for c, u in speed.items()))
    return speed


def model_rounds(spec: str, cores: dict, all_cpus) -> None:
    import torch
    from fxopt.bench.models import build_model
    from fxopt.bench.runners import host_ms_per_call, time_calls
    from fxopt.testing import compile_with_fxopt
    name, dtype, batch = spec.split(":")
    model, shape = build_model(name)
    model = model.eval().cuda().to(getattr(torch, dtype))
    x = torch.randn(int(batch), *shape, device="cuda", dtype=getattr(torch, dtype))
    c = compile_with_fxopt(model, {}, [])
    with torch.no_grad():
        for _ in range(20):
            c(x)
        torch.cuda.synchronize()
        for label, cpus in [("unpinned", all_cpus)] + [(f"pinned to {k} core {v}", {v}) for k, v in cores.items()]:
            os.sched_setaffinity(0, cpus)
            rounds = []
            for _ in range(8):
                for _ in range(10):
                    c(x)
                e2e = statistics.median(time_calls(c, x, "cuda", 50)) * 1e3
                host = host_ms_per_call(c, x, 200) * 1e3
                rounds.append((e2e, host, current_cpu(), block_us(50)[0]))
                time.sleep(0.2)
            print(f"{spec} {label}: e2e/host/core/python-block per round: "
                  + "  ".join(f"{e:.1f}/{h:.1f}/{cpu}/{p:.1f}" for e, h, cpu, p in rounds), flush=True)
    os.sched_setaffinity(0, all_cpus)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--model", default=None, help="e.g. seedcnn:float32:1")
    a = p.parse_args()
    facts()
    cpus = sorted(os.sched_getaffinity(0))
    drift(a.seconds)
    speed = per_core(cpus)
    os.sched_setaffinity(0, set(cpus))
    if a.model:
        fast, slow = min(speed, key=speed.get), max(speed, key=speed.get)
        model_rounds(a.model, {"fastest": fast, "slowest": slow}, set(cpus))


if __name__ == "__main__":
    main()
