"""The Hugging Face side of limpet's LLaMA-family interop tests (run by hf_interop.rs).

    hf_llama.py make ROOT SHARD_SIZE VARIANT...  a tiny random model of each VARIANT, saved to
                                                 ROOT/VARIANT
    hf_llama.py logits TOKENS OUT DIR...         load each DIR with AutoModelForCausalLM, write its
                                                 logits for TOKENS (a JSON list of lists) to OUT
                                                 (safetensors; key i for the i-th DIR)
    hf_llama.py evil FILE MARKER                 a torch.save archive whose unpickling would
                                                 create MARKER

Each variant exercises what its family computes differently: rotary scaling with a context
past the original length, grouped-query attention 8:1, head_dim != hidden/heads, q/k/v biases,
q/k norms, tied and untied heads, bf16 weights and PyTorch `.bin` files.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

torch.set_num_threads(1)

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def config(variant):
    theta = {"rope_type": "default", "rope_theta": 10000.0}
    if variant in ("untied", "tied", "bin", "bf16"):
        return LlamaConfig(**SMALL, rope_parameters=theta, tie_word_embeddings=variant in ("tied", "bin"),
                           bos_token_id=1, eos_token_id=2)
    if variant == "llama3":
        # Llama 3.1's scaling with theta 500000: head_dim 16 has frequencies in all three of
        # its bands (kept, smoothed, divided) when the original context is 40; GQA 8:1.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 40}
        cfg = dict(SMALL, hidden_size=128, num_attention_heads=8, num_key_value_heads=1)
        return LlamaConfig(**cfg, rope_parameters=rope, tie_word_embeddings=False,
                           bos_token_id=96, eos_token_id=[95, 94])
    if variant == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 16}
        return LlamaConfig(**SMALL, rope_parameters=rope)
    if variant == "linear":
        return LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if variant == "dynamic":
        return LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    if variant == "mistral":
        return MistralConfig(**SMALL, rope_parameters=theta, sliding_window=64)
    if variant == "qwen2":
        return Qwen2Config(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=True)
    if variant == "qwen3":
        # head_dim 32 with 4 heads over a width of 64: the heads are wider than the stream.
        return Qwen3Config(**SMALL, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=False)
    raise SystemExit(f"unknown variant {variant}")


def make(out, variant, shard_size):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(variant))
    # Random norm scales and biases too, so a swapped or ignored one shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    if variant == "bin":
        # A PyTorch-format checkpoint: the state dict as torch.save writes it (the tied head
        # included, as older checkpoints have it), and no safetensors file.
        model.config.save_pretrained(out)
        torch.save(model.state_dict(), os.path.join(out, "pytorch_model.bin"))
        return
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=shard_size)


def load(src):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    return model


def logits(tokens, out, dirs):
    ids = torch.tensor(json.loads(tokens), dtype=torch.long)
    ys = {}
    for i, src in enumerate(dirs):
        with torch.no_grad():
            ys[str(i)] = load(src)(input_ids=ids).logits.contiguous()
    save_file(ys, out)


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        for v in sys.argv[4:]:
            os.makedirs(os.path.join(sys.argv[2], v), exist_ok=True)
            make(os.path.join(sys.argv[2], v), v, sys.argv[3])
    elif sys.argv[1] == "evil":
        torch.save({"model.embed_tokens.weight": Evil(sys.argv[3])}, sys.argv[2])
    else:
        logits(sys.argv[2], sys.argv[3], sys.argv[4:])
