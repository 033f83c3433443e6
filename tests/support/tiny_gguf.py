"""A tiny llama-architecture GGUF with random weights, written locally: no model hub.

    python -m tests.support.tiny_gguf OUT.gguf [--embd 64] [--layers 2] [--ff 128]

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
UNK, BOS, EOS = 0, 1, 2


def vocabulary() -> tuple[list[str], list[int], list[bool]]:
    """Tokens, their GGUF token types and whether the model may emit each."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    printable = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    tokens += printable
    types += [gguf.TokenType.NORMAL] * len(printable)
    emit = [False] * (3 + 256) + [True] * len(printable)
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
) -> Path:
    """Write the model to `path` (parents created) and return `path`."""
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
    rng = np.random.default_rng(seed)
    tokens, types, emit = vocabulary()
    n_vocab = len(tokens)

    def weights(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("corrallm-tiny-random")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
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
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for i in range(n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{blk}.{name}.weight", weights(n_embd, n_embd, std=0.02))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weights(n_ff, n_embd, std=0.02))
        writer.add_tensor(f"{blk}.ffn_up.weight", weights(n_ff, n_embd, std=0.02))
        writer.add_tensor(f"{blk}.ffn_down.weight", weights(n_embd, n_ff, std=0.02))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=128)
    args = p.parse_args(argv)
    path = write_tiny_gguf(args.out, n_embd=args.embd, n_layer=args.layers, n_ff=args.ff)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
