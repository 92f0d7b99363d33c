"""Allreduce through torch.distributed's gloo backend, timed the way `limpet-lab bench
allreduce` times its own ring: per size, a barrier, warm-up iterations, then the average of
`iters` back-to-back allreduces of a float32 tensor, measured on rank 0.

Usage: python gloo_allreduce.py WORLD PORT SIZE_BYTES:ITERS [SIZE_BYTES:ITERS ...]
Prints one JSON object on stdout: {"sizes": [{"bytes": B, "seconds": S}, ...]}.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, port, plan, out_path):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = []
    for nbytes, iters in plan:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        elapsed = time.perf_counter() - start
        results.append({"bytes": nbytes, "seconds": elapsed / iters})
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"sizes": results}, f)
    dist.destroy_process_group()


def main():
    world, port = int(sys.argv[1]), int(sys.argv[2])
    plan = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[3:]]
    out_path = f"/tmp/limpet-gloo-{os.getpid()}.json"
    mp.spawn(run, args=(world, port, plan, out_path), nprocs=world, join=True)
    with open(out_path) as f:
        print(f.read())
    os.remove(out_path)


if __name__ == "__main__":
    main()
