"""The peer of `limpet-lab bench dp`: torchrun + DistributedDataParallel (gloo) training the same
LLaMA in transformers on the same global batch, one libtorch thread per rank.

    torchrun --nproc_per_node W ddp_llama.py CONFIG_JSON GLOBAL_BATCH CONTEXT STEPS WARMUP [adamw|zero]

`zero` shards AdamW's state over the ranks with PyTorch's ZeroRedundancyOptimizer (ZeRO-1).
Rank 0 prints one JSON line: {"samples_per_s": ..., "steps": ..., "peak_rss_bytes": ...,
"rss_bytes": ...}: the largest peak resident memory of any rank, and the largest after the last
step.
"""
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

cfg_path, batch, context, steps, warmup = sys.argv[1], *map(int, sys.argv[2:6])
sharded = len(sys.argv) > 6 and sys.argv[6] == "zero"
torch.set_num_threads(1)
torch.set_num_interop_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
cfg = LlamaConfig(**json.load(open(cfg_path)))
cfg._attn_implementation = "sdpa"
model = DDP(LlamaForCausalLM(cfg))
if sharded:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.1
    )
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
per_rank = batch // world + (1 if rank < batch % world else 0)
gen = torch.Generator().manual_seed(1 + rank)
dist.barrier()
for step in range(warmup + steps):
    if step == warmup:
        dist.barrier()
        started = time.perf_counter()
    ids = torch.randint(0, cfg.vocab_size, (per_rank, context + 1), generator=gen)
    out = model(input_ids=ids[:, :-1])
    # A sum over the rank's samples divided by the global batch: DDP's average over ranks then
    # gives the global batch's mean, as limpet computes it.
    loss = torch.nn.functional.cross_entropy(
        out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1), reduction="sum"
    ) / (context * batch / world)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
def resident():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


now = resident()
dist.barrier()
elapsed = time.perf_counter() - started
# ru_maxrss is in KiB on Linux; each the largest over the ranks.
rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, now], dtype=torch.int64)
dist.all_reduce(rss, op=dist.ReduceOp.MAX)
if rank == 0:
    print(json.dumps({"samples_per_s": batch * steps / elapsed, "steps": steps,
                      "peak_rss_bytes": int(rss[0]), "rss_bytes": int(rss[1])}))
dist.destroy_process_group()
