"""A Llama-3-style tokenizer made locally (no downloads here), and the check of limpet's shards
against it (run by workload_processes.rs; docs/workloads.md uses it too).

    llama3_tokenizer.py make DIR TEXT...     a byte-level BPE of 512 tokens trained on TEXT files,
                                             with Llama 3's special tokens and post-processor
                                             (<|begin_of_text|> before every sequence), saved by
                                             transformers as DIR/tokenizer.json and
                                             DIR/tokenizer_config.json
    llama3_tokenizer.py model DIR TOKDIR     a random Llama-3-shaped model for that tokenizer
                                             (llama3 rotary scaling, theta 500000, GQA 4:1,
                                             bf16 weights, its BOS/EOS ids), saved to DIR
    llama3_tokenizer.py generate DIR TEXT    greedy-generate after TEXT with the model and
                                             tokenizer in DIR; print JSON: the new text, and
                                             whether generation stopped at EOS
    llama3_tokenizer.py check DIR SHARDS DOCS.jsonl
                                             the token stream in SHARDS (train and held-out
                                             chunks put back in order) must be, document by
                                             document, what transformers' tokenizer gives each
                                             record followed by <|end_of_text|>
    llama3_tokenizer.py parquet DOCS.jsonl OUT.parquet CODEC
                                             the records' text as column "text" of a Parquet
                                             file written by pyarrow (beside an int column "n"),
                                             in row groups of 64 rows, compressed with CODEC
"""
import json
import os
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def make(out, texts):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train(texts, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tk.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(out)


def check(tok_dir, shards, docs):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.convert_tokens_to_ids(EOS)
    want = []
    with open(docs) as f:
        for line in f:
            if line.strip():
                want += tok(json.loads(line)["text"])["input_ids"] + [eos]
    m = json.load(open(os.path.join(shards, "limpet-tokens.json")))
    dtype = np.uint16 if m["dtype"] == "uint16" else np.uint32

    def stream(entries):
        parts = [np.fromfile(os.path.join(shards, e["file"]), dtype=dtype) for e in entries]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    train, val = stream(m["train"]), stream(m.get("val", []))
    got, t, v, k = [], 0, 0, 0
    while t < len(train) or v < len(val):
        if k % 20 == 19:
            got += val[v:v + 1024].tolist()
            v += 1024
        else:
            got += train[t:t + 1024].tolist()
            t += 1024
        k += 1
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        sys.exit(f"limpet's stream differs from transformers' at token {first} "
                 f"(limpet {got[first:first + 8]}, transformers {want[first:first + 8]}; "
                 f"lengths {len(got)} and {len(want)})")
    print(f"{len(want)} tokens match, {want.count(eos)} documents")


def parquet(docs, out, codec):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(docs) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    table = pa.table({"n": list(range(len(texts))), "text": texts})
    pq.write_table(table, out, row_group_size=64, compression=codec)


def model(out, tok_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


def generate(src, text):
    import torch
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(src)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = tok(text, return_tensors="pt").input_ids
    out = m.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    print(json.dumps({"text": tok.decode(out), "tokens": len(out),
                      "eos": m.generation_config.eos_token_id, "stopped_at_eos": out[-1:] == [tok.eos_token_id]}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "model":
        model(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "parquet":
        parquet(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], sys.argv[3])
    else:
        check(sys.argv[2], sys.argv[3], sys.argv[4])
