"""A small Llama-architecture model with random weights from a fixed seed, for paths the
embedded model cannot take: 4 KV heads (two tensor-parallel workers split them; the
embedded model has 3) and a 40K context window (documents of 32K tokens and more).
Used by the tests (``random_llama`` in conftest) and by ``bench/publish.py --long``."""

from __future__ import annotations

import shutil
from pathlib import Path

#: Its shape: 4 layers of 8 query and 4 KV heads of 64, 512 wide.
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 8, 4, 64, 512
CONTEXT = 40960


def build_random_llama(folder: Path, query_heads: int = HEADS) -> Path:
    """The model in ``folder``: bf16 safetensors and the embedded model's tokenizer (so
    documents are framed as for the real model). Its text is meaningless, but an
    engine's own prefill is a baseline loaded KV must match. Weights drawn wider than
    the default (``initializer_range``) make greedy answers vary token to token.

    ``query_heads``: 8 (grouped-query attention, as the benchmarks measure), or 4, one
    a KV head: the same KV, which is all kvcdn moves, at half the attention's cost
    (the suite's 33K-token prefills)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvcdn.models import model_folder

    source = Path(model_folder("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=query_heads, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, rope_theta=100000.0,
        initializer_range=0.2, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):  # fmt: skip
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder
