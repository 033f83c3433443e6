"""A tiny llama-architecture GGUF with random weights, written locally: no model hub.

    python -m tests.support.tiny_gguf OUT.gguf [--embd 64] [--layers 2] [--ff 128]
        [--heads 4] [--kv-heads N] [--vocab N] [--dtype F32|F16|Q8_0|Q4_0]

Deterministic (fixed seed: the same arguments give the same bytes). The defaults make a
~0.5 MB model that real `llama-server` loads in milliseconds and serves chat, streaming
and usage with. Its vocabulary is a byte-level SentencePiece one (`<unk>`, `<s>`, `</s>`,
the 256 `<0xNN>` byte tokens) plus the printable ASCII characters and `▁` (the space), and
its GGUF metadata carries a ChatML `tokenizer.chat_template`.

The random weights are shaped so that the output is always printable ASCII and never the
end-of-sequence token: every token embedding carries a large constant in dimension 0 that
the (weak) layers leave dominant, and the output matrix gives printable tokens +A and
every other token -A in that dimension. So a completion runs to `max_tokens` exactly and
is valid UTF-8, which makes token counts assertable.

Bigger shapes (the memory-estimate bench and tests) come from the keyword parameters:
`n_head_kv` (grouped-query attention), `n_vocab` (the vocabulary padded with tokens the
model never emits), `dtype` (the 2-D matrices as F16, Q8_0 or Q4_0 instead of F32) and `split`
(that many `-0000N-of-0000M.gguf` shards). With the defaults the bytes are unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

SEED = 20240601
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPACE = "\u2581"  # SentencePiece's visible space
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
UNK, BOS, EOS = 0, 1, 2


def vocabulary(n_vocab: int | None = None) -> tuple[list[str], list[int], list[bool]]:
    """Tokens, their GGUF token types and whether the model may emit each; `n_vocab` pads
    the list with normal tokens (`▁w0`, `▁w1`...) that the model never emits."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    printable = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    tokens += printable
    types += [gguf.TokenType.NORMAL] * len(printable)
    emit = [False] * (3 + 256) + [True] * len(printable)
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab {n_vocab} is below the {len(tokens)} base tokens")
        extra = n_vocab - len(tokens)
        tokens += [f"{SPACE}w{i}" for i in range(extra)]
        types += [gguf.TokenType.NORMAL] * extra
        emit += [False] * extra
    return tokens, [int(t) for t in types], emit


def write_tiny_gguf(
    path: Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_ff: int = 128,
    n_head: int = 4,
    n_ctx_train: int = 2048,
    seed: int = SEED,
    n_head_kv: int | None = None,
    n_vocab: int | None = None,
    dtype: str = "F32",
    split: int = 1,
) -> Path:
    """Write the model to `path` (parents created) and return `path`; with `split` > 1 the
    shards are `path`'s stem + `-00001-of-0000N.gguf`... (N at most `split`: the tensors are
    dealt out evenly) and the first shard is returned."""
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
    kv_heads = n_head if n_head_kv is None else n_head_kv
    if n_head % kv_heads:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {kv_heads}")
    if dtype not in FILE_TYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(FILE_TYPES)}")
    rng = np.random.default_rng(seed)
    tokens, types, emit = vocabulary(n_vocab)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    def weights(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    # Split shards: the writer distributes tensors over `split` files of the llama.cpp names.
    per_shard = 0 if split <= 1 else -(-(3 + 9 * n_layer) // split)
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=per_shard)
    writer.add_name("corrallm-tiny-random")
    writer.add_file_type(FILE_TYPES[dtype])
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # Dimension 0 of the residual stream is a large constant the layers barely disturb.
    embed = weights(n_vocab, n_embd, std=0.1)
    embed[:, 0] = 3.0
    output = weights(n_vocab, n_embd, std=2.0)
    output[:, 0] = np.where(np.array(emit), 2.0, -2.0)

    def matrix(name: str, data: np.ndarray) -> None:
        """A 2-D weight in the model's dtype (norm vectors stay F32, as converters do)."""
        if dtype == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif dtype in ("Q8_0", "Q4_0"):
            qtype = gguf.GGMLQuantizationType[dtype]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)

    matrix("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    matrix("output.weight", output)
    for i in range(n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        matrix(f"{blk}.attn_q.weight", weights(n_embd, n_embd, std=0.02))
        matrix(f"{blk}.attn_k.weight", weights(kv_heads * head_dim, n_embd, std=0.02))
        matrix(f"{blk}.attn_v.weight", weights(kv_heads * head_dim, n_embd, std=0.02))
        matrix(f"{blk}.attn_output.weight", weights(n_embd, n_embd, std=0.02))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        matrix(f"{blk}.ffn_gate.weight", weights(n_ff, n_embd, std=0.02))
        matrix(f"{blk}.ffn_up.weight", weights(n_ff, n_embd, std=0.02))
        matrix(f"{blk}.ffn_down.weight", weights(n_embd, n_ff, std=0.02))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    shards = writer.format_shard_names(path)
    writer.close()
    return shards[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(FILE_TYPES), default="F32")
    args = p.parse_args(argv)
    path = write_tiny_gguf(
        args.out,
        n_embd=args.embd,
        n_layer=args.layers,
        n_ff=args.ff,
        n_head=args.heads,
        n_head_kv=args.kv_heads,
        n_vocab=args.vocab,
        dtype=args.dtype,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
