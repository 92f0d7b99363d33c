"""The peer of `limpet-lab bench dp`: torchrun + DistributedDataParallel (gloo) training the same
LLaMA in transformers on the same global batch, one libtorch thread per rank.

    torchrun --nproc_per_node W ddp_llama.py CONFIG_JSON GLOBAL_BATCH CONTEXT STEPS WARMUP

Rank 0 prints one JSON line: {"samples_per_s": ..., "steps": ...}.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

cfg_path, batch, context, steps, warmup = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads(1)
torch.set_num_interop_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
cfg = LlamaConfig(**json.load(open(cfg_path)))
cfg._attn_implementation = "sdpa"
model = DDP(LlamaForCausalLM(cfg))
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
dist.barrier()
elapsed = time.perf_counter() - started
if rank == 0:
    print(json.dumps({"samples_per_s": batch * steps / elapsed, "steps": steps}))
dist.destroy_process_group()
