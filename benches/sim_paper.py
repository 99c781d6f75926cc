"""NEO's relative-throughput results next to the simulator's, as a markdown table (the one in
docs/SIMULATOR.md): T4 + Llama-2-7B on the summarization-like load, A10G + Llama-3-8B with input
1000 and outputs 50-400 on g5.2x-16xlarge hosts, 2xH100 + Llama-3-70B. All requests arrive at
once; throughput is output tokens over the makespan.

    python benches/sim_paper.py [--num-requests 1000]
"""

from __future__ import annotations

import argparse
import time

from neo_rs.bench import workloads
from neo_rs.bench.arrivals import arrival_times
from neo_rs.sim.cost import CostModel
from neo_rs.sim.profiles import GPUS, HOSTS, MODELS
from neo_rs.sim.simulate import simulate


def gain(gpu: str, host: str, model: str, reqs: list[workloads.BenchRequest]) -> float:
    cost = CostModel(GPUS[gpu], HOSTS[host], MODELS[model])
    arrivals = arrival_times(len(reqs), float("inf"), 1.0, 0)
    neo = simulate(cost, "neo", reqs, arrivals)
    none = simulate(cost, "none", reqs, arrivals)
    return neo.output_throughput / none.output_throughput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000)
    n = ap.parse_args().num_requests
    start = time.perf_counter()
    print("| setting | paper (neo vs GPU-only) | simulator (neo / none throughput) |")
    print("|---|---|---|")
    g = gain("T4", "g4dn.4xlarge", "llama-2-7b", workloads.osc(n, 0))
    print(f"| T4 + Llama-2-7B, summarization-like | up to 7.5x | {g:.2f}x |")
    outs = (50, 100, 200, 300, 400)
    for host in ("g5.2xlarge", "g5.4xlarge", "g5.8xlarge", "g5.16xlarge"):
        gains = [gain("A10G", host, "llama-3-8b", workloads.synthetic(n, 1000, o, 0)) for o in outs]
        cells = ", ".join(f"{o}: {x:.2f}x" for o, x in zip(outs, gains, strict=True))
        paper = {"g5.4xlarge": "up to 1.26x", "g5.16xlarge": "up to 1.79x"}.get(host, "")
        print(f"| A10G + Llama-3-8B, {host}, input 1000 | {paper} | {cells} |")
    g = gain("2xH100", "server", "llama-3-70b", workloads.synthetic(n, 1000, 300, 0))
    print(f"| 2xH100 + Llama-3-70B, input 1000, output 300 | up to 1.14x | {g:.2f}x |")
    runs = 2 * (2 + 4 * len(outs))
    print(f"\n({time.perf_counter() - start:.0f} s for {runs} simulations of {n} requests)")


if __name__ == "__main__":
    main()
