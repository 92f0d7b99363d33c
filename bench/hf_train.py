"""The peer of `limpet-lab bench train`: the same LLaMA in transformers (PyTorch eager), trained
on the same batch shape with the same optimizer, threads and gradient clipping.

    hf_train.py CONFIG_JSON BATCH CONTEXT STEPS WARMUP THREADS [DEVICE]

DEVICE is `cpu` (the default) or `cuda` (the GPU kit's peer: deploy/gpu-check.sh), where each
step is timed between two synchronizations. Prints one JSON line:
{"tokens_per_s": ..., "step_ms": [...], "ms_per_step": ..., "device": ...}.
"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

cfg_path, (batch, context, steps, warmup, threads) = sys.argv[1], map(int, sys.argv[2:7])
device = torch.device(sys.argv[7] if len(sys.argv) > 7 else "cpu")


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


torch.set_num_threads(threads)
torch.set_num_interop_threads(1)
torch.manual_seed(0)
cfg = LlamaConfig(**json.load(open(cfg_path)))
cfg._attn_implementation = "sdpa"
model = LlamaForCausalLM(cfg).to(device)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
gen = torch.Generator().manual_seed(1)
times = []
for step in range(warmup + steps):
    ids = torch.randint(0, cfg.vocab_size, (batch, context + 1), generator=gen).to(device)
    sync()
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    if step >= warmup:
        times.append(time.perf_counter() - t0)
print(json.dumps({
    "tokens_per_s": batch * context * len(times) / sum(times),
    "step_ms": [1e3 * t for t in times],
    "ms_per_step": 1e3 * sum(times) / len(times),
    "device": str(device),
}))
