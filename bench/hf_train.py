"""The peer of `limpet-lab bench train`: the same LLaMA in transformers (PyTorch eager), trained
on the same batch shape with the same optimizer, threads and gradient clipping.

    hf_train.py CONFIG_JSON BATCH CONTEXT STEPS WARMUP THREADS

Prints one JSON line: {"tokens_per_s": ..., "step_ms": [...]}.
"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

cfg_path, batch, context, steps, warmup, threads = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads(threads)
torch.set_num_interop_threads(1)
torch.manual_seed(0)
cfg = LlamaConfig(**json.load(open(cfg_path)))
cfg._attn_implementation = "sdpa"
model = LlamaForCausalLM(cfg)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
gen = torch.Generator().manual_seed(1)
times = []
for step in range(warmup + steps):
    ids = torch.randint(0, cfg.vocab_size, (batch, context + 1), generator=gen)
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step >= warmup:
        times.append(time.perf_counter() - t0)
print(json.dumps({"tokens_per_s": batch * context * len(times) / sum(times), "step_ms": [1e3 * t for t in times]}))
