"""The Hugging Face side of limpet's LLaMA interop test (run by hf_interop.rs).

    hf_llama.py make DIR TIED SHARD_SIZE   a tiny random LlamaForCausalLM, save_pretrained to DIR
    hf_llama.py logits DIR TOKENS OUT      load DIR with from_pretrained, write its logits for
                                           TOKENS (a JSON list of lists) to OUT (safetensors)
"""
import json
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)


def make(out, tied, shard_size):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    # Random norm scales too, so a swapped or ignored norm shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out, max_shard_size=shard_size)


def logits(src, tokens, out):
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(json.loads(tokens), dtype=torch.long)
    with torch.no_grad():
        y = model(input_ids=ids).logits
    save_file({"logits": y.contiguous()}, out)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3] == "tied", sys.argv[4])
    else:
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
