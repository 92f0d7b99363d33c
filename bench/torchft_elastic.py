"""The torchft peer of `limpet-lab bench elastic`: the same MLP (64-128-128-10, AdamW, global
batch 64) on the same digits data, trained by torchft replica groups of one process each over
gloo, coordinated by torchft's lighthouse. One group is killed with `kill -9`; the survivors
drop it from their quorum and go on from their own state, as limpet's survivors do.

Run by `limpet-lab bench elastic` as:
  python torchft_elastic.py lighthouse OUT MIN_REPLICAS JOIN_TIMEOUT_MS
      writes the lighthouse's address to OUT/lighthouse and serves until killed;
  python torchft_elastic.py replica OUT ID LIGHTHOUSE STEPS
      with DIGITS in the environment; writes its pid to OUT/pid-ID and appends one JSON line
      per step to OUT/steps-ID.jsonl: {"wall_ms", "step", "committed", "participants"}.
The lighthouse's other settings (quorum tick 100 ms, heartbeat timeout 5 s) are those
`torchft_lighthouse` defaults to.
"""
import gzip
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
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


def lighthouse(out, min_replicas, join_timeout_ms):
    from torchft.coordination import LighthouseServer

    # The other settings as `torchft_lighthouse` defaults them (this binding's own defaults
    # differ: its join timeout is 100 ms, the command's 60 s).
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=int(min_replicas),
        join_timeout_ms=int(join_timeout_ms),
        quorum_tick_ms=100,
        heartbeat_timeout_ms=5000,
    )
    tmp = os.path.join(out, "lighthouse.tmp")
    with open(tmp, "w") as f:
        f.write(server.address())
    os.replace(tmp, os.path.join(out, "lighthouse"))
    while True:
        time.sleep(3600)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(out, rid, lighthouse_addr, steps):
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    with open(os.path.join(out, f"pid-{rid}"), "w") as f:
        f.write(str(os.getpid()))
    x, y = load_digits(os.environ["DIGITS"])
    n_train = int(len(x) * 0.8)
    x, y = x[:n_train], y[:n_train]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)

    # Each replica group is one process: its own store, rank 0 of a group of one.
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        use_async_quorum=False,
        store_addr="127.0.0.1",
        store_port=port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"replica_{rid}",
        timeout=timedelta(seconds=10),
    )
    opt = Optimizer(manager, inner)
    batch = 64
    log = open(os.path.join(out, f"steps-{rid}.jsonl"), "a")
    while manager.current_step() < int(steps):
        opt.zero_grad()  # the quorum, before the batch is cut by it
        step = manager.current_step()
        rank = manager.participating_rank() or 0
        world = max(manager.num_participants(), 1)
        # The global batch of step s is a pure function of s, as in limpet.
        g = torch.Generator().manual_seed(step // (n_train // batch))
        perm = torch.randperm(n_train, generator=g)
        pos = (step % (n_train // batch)) * batch
        idx = perm[pos : pos + batch][rank::world]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        # The gradients averaged over the quorum through the Manager (torchft's DDP wrapper
        # does the same in a comm hook, which failed an assertion in a survivor when a peer
        # died mid-step: torchft 0.2.0, torch 2.13).
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        opt.step()
        committed = manager.current_step() > step
        line = {"wall_ms": int(time.time() * 1000), "step": step, "committed": committed, "participants": world}
        log.write(json.dumps(line) + "\n")
        log.flush()
    del store


if __name__ == "__main__":
    if sys.argv[1] == "lighthouse":
        lighthouse(*sys.argv[2:5])
    else:
        replica(*sys.argv[2:6])
