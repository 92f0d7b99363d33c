"""The peer of `limpet-lab bench elastic`: the same MLP (64-128-128-10, AdamW, global batch 64)
on the same digits data, trained with torch.distributed (gloo) under torchrun, PyTorch's
elastic launcher, with a checkpoint every CKPT_EVERY steps. That is how torchrun users survive
a lost worker: torchrun stops every worker, restarts the group, and training resumes from the
last checkpoint.

Run by `limpet-lab bench elastic` as:
  python -m torch.distributed.run --standalone --nproc-per-node=N --max-restarts=3 \
      torchrun_elastic.py
with DIGITS, OUT (directory), STEPS and CKPT_EVERY in the environment. Each worker writes its
pid to OUT/pid-<restart>-<rank>; rank 0 appends one JSON line per completed step to
OUT/steps.jsonl: {"wall_ms", "step", "world", "restart"}.
"""
import gzip
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def load_digits(path):
    rows = []
    with gzip.open(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append([float(v) for v in line.split(",")])
    data = torch.tensor(rows)
    return data[:, :64] / 16.0, data[:, 64].long()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = os.environ["OUT"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(out, f"pid-{restart}-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    steps = int(os.environ["STEPS"])
    every = int(os.environ["CKPT_EVERY"])
    ckpt = os.path.join(out, "checkpoint.pt")
    x, y = load_digits(os.environ["DIGITS"])
    n_train = int(len(x) * 0.8)
    x, y = x[:n_train], y[:n_train]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    batch = 64
    log = open(os.path.join(out, "steps.jsonl"), "a") if rank == 0 else None
    for step in range(start, steps):
        # The global batch of step s is a pure function of s, as in limpet.
        g = torch.Generator().manual_seed(step // (n_train // batch))
        perm = torch.randperm(n_train, generator=g)
        pos = (step % (n_train // batch)) * batch
        idx = perm[pos : pos + batch][rank::world]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if log:
            log.write(json.dumps({"wall_ms": int(time.time() * 1000), "step": step, "world": world, "restart": restart}) + "\n")
            log.flush()
        if rank == 0 and (step + 1) % every == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
