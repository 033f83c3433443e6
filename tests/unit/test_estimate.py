"""M1: the llama-server memory estimate from GGUF headers and flags, by example.

Models are written with the gguf writer (tests/support/tiny_gguf.py, or `write_gguf` below
for shapes llama.cpp need not load); expected sizes are worked out here from the tensors'
bytes as `gguf.GGUFReader` reads them, independently of the estimator's header reader.
Accuracy against real llama-server processes is tests/integration/test_estimate_llama.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from corrallm.residency.estimate import (
    KV_PAD,
    RUNTIME_RSS,
    VOCAB_TOKEN_BYTES,
    Estimate,
    EstimateError,
    Parts,
    estimate,
    host_repack_types,
    is_llama_server,
)
from corrallm.residency.gguf_header import Counted, read_header
from tests.support.tiny_gguf import vocabulary, write_tiny_gguf

LLAMA = "/opt/llama/bin/llama-server"
NO_REPACK: frozenset[int] = frozenset()
N_VOCAB = len(vocabulary()[0])  # 354
EMBD, FF, HEADS = 64, 128, 4  # tiny_gguf's defaults


def est(model: Path | str, *flags: str, repack: frozenset[int] = NO_REPACK, **kw: Any) -> Estimate:
    return estimate(
        [LLAMA, "-m", str(model), "--port", "${PORT}", *flags], repack_types=repack, **kw
    )


def tensor_bytes(path: Path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}


def layer_bytes(sizes: Mapping[str, int], il: int) -> int:
    return sum(n for name, n in sizes.items() if name.startswith(f"blk.{il}."))


def kv_bytes(cells: int, n_layer: int, width: int, k: float = 2, v: float = 2) -> int:
    return int(cells * n_layer * width * (k + v))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, n_embd 64, 4 heads (MHA), F32, context_length 2048."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny4.gguf", n_layer=4)


def write_gguf(
    path: Path,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, tuple[tuple[int, ...], gguf.GGMLQuantizationType]],
    arch: str = "llama",
) -> Path:
    """A header-level GGUF (zero weights) with any metadata and tensor shapes (numpy order)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (shape, qtype) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- which command lines are estimated --------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["llama-server", "-m", "x.gguf"], True),
        (["/usr/local/bin/llama-server"], True),
        (["C:\\llama\\llama-server.exe", "-m", "x"], True),
        (["llama-cli", "-m", "x.gguf"], False),
        (["python", "-m", "llama_cpp.server"], False),
        (["vllm", "serve"], False),
        ([], False),
    ],
)
def test_M1_is_llama_server_by_program_name(argv: list[str], expected: bool) -> None:
    assert is_llama_server(argv) is expected


def test_M1_other_programs_are_not_estimated() -> None:
    with pytest.raises(EstimateError, match="cmd runs 'vllm', not llama-server"):
        estimate(["vllm", "serve", "-m", "x.gguf"])


def test_M1_without_a_model_file_there_is_no_estimate() -> None:
    with pytest.raises(EstimateError, match="has no -m FILE"):
        estimate([LLAMA, "--port", "${PORT}"])
    with pytest.raises(EstimateError, match="comes from -hf"):
        estimate([LLAMA, "-hf", "org/model-GGUF"])


def test_M1_missing_file_names_the_path_and_the_flag(tmp_path: Path) -> None:
    with pytest.raises(EstimateError, match=f"{tmp_path}/nope.gguf does not exist.*-m nope.gguf"):
        estimate([LLAMA, "-m", "nope.gguf"], cwd=str(tmp_path))


def test_M1_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(EstimateError, match=r"model.bin is not a GGUF file \(it starts with"):
        est(tmp_path / "model.bin")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(EstimateError, match="is not a GGUF file"):
        est(tmp_path / "empty.gguf")


def test_M1_a_truncated_gguf_is_refused(tmp_path: Path, tiny: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:2000])
    with pytest.raises(EstimateError, match="truncated or corrupt"):
        est(cut)


def test_M1_unreadable_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.gguf").mkdir()  # unreadable as a file, even for root
    with pytest.raises(EstimateError, match=r"cannot read .*dir\.gguf: "):
        est(tmp_path / "dir.gguf")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-c", "big"], "-c 'big' is not an integer"),
        (["-c", "-5"], "-c '-5' is negative"),
        (["-ctk", "q3_k"], "-ctk 'q3_k' is not one of f32, f16, bf16, q8_0"),
        (["-ngl", "most"], "-ngl 'most' is not an integer"),
        (["--flash-attn=maybe"], "--flash-attn 'maybe' is not one of on, off, auto"),
        (["-ot", "exps"], "-ot 'exps' is not PATTERN=BUFFER_TYPE"),
        (["-c"], "-c needs a value"),
    ],
)
def test_M1_bad_flag_values_are_reported(tiny: Path, flags: list[str], message: str) -> None:
    with pytest.raises(EstimateError, match=message):
        est(tiny, *flags)


# --- weights ------------------------------------------------------------------------------


def test_M1_cpu_only_weights_are_every_tensor(tiny: Path) -> None:
    e = est(tiny, "-ngl", "0", "-c", "2048")
    assert (e.gpu, e.system.weights) == (Parts(), sum(tensor_bytes(tiny).values()))
    assert e.files == (str(tiny),)


def test_M1_ngl_offloads_the_output_layer_then_the_last_layers(tiny: Path) -> None:
    """llama.cpp: -ngl N puts the output layer and the last N-1 repeating layers on the GPU."""
    sizes = tensor_bytes(tiny)
    output = sizes["output.weight"] + sizes["output_norm.weight"]
    placed = {}
    for n in (1, 3, 5):
        e = est(tiny, "-ngl", str(n), "-c", "2048")
        placed[n] = (e.gpu.weights, e.system.weights)
    everything = sum(sizes.values())
    three = output + layer_bytes(sizes, 2) + layer_bytes(sizes, 3)
    all_but_input = everything - sizes["token_embd.weight"]
    assert placed == {
        1: (output, everything - output),
        3: (three, everything - three),
        5: (all_but_input, sizes["token_embd.weight"]),
    }


@pytest.mark.parametrize("word", ["99", "all", "auto", "-1", None])
def test_M1_ngl_all_auto_or_absent_offloads_everything(tiny: Path, word: str | None) -> None:
    flags = ["-c", "2048"] + (["--n-gpu-layers", word] if word is not None else [])
    e = est(tiny, *flags)
    sizes = tensor_bytes(tiny)
    assert e.gpu.weights == sum(sizes.values()) - sizes["token_embd.weight"]
    if word != "99":
        assert f"-ngl {word or 'auto'} taken as all 5 layers on the GPU" in e.notes


def test_M1_split_model_sums_every_shard(tmp_path: Path) -> None:
    whole = write_tiny_gguf(tmp_path / "whole.gguf", n_layer=4)
    first = write_tiny_gguf(tmp_path / "split" / "m.gguf", n_layer=4, split=3)
    assert first.name == "m-00001-of-00003.gguf"
    a, b = est(whole, "-ngl", "0"), est(first, "-ngl", "0")
    assert b.system.weights == a.system.weights
    assert b.files == tuple(str(tmp_path / "split" / f"m-0000{i}-of-00003.gguf") for i in (1, 2, 3))
    # Naming any shard finds them all; a missing one is named.
    assert est(tmp_path / "split" / "m-00002-of-00003.gguf", "-ngl", "0").files == b.files
    (tmp_path / "split" / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(EstimateError, match=r"shard .*m-00003-of-00003\.gguf is missing"):
        est(first)


def test_M1_split_metadata_without_split_names_is_refused(tmp_path: Path) -> None:
    first = write_tiny_gguf(tmp_path / "m.gguf", split=2)
    renamed = first.rename(tmp_path / "renamed.gguf")
    with pytest.raises(EstimateError, match="2-file split model but is not named"):
        est(renamed)


def test_M1_repacked_weights_count_twice_with_mmap(tmp_path: Path) -> None:
    """ggml's CPU backend repacks Q4_0 into a buffer of its own; the mapped file stays resident."""
    model = write_tiny_gguf(tmp_path / "q4.gguf", dtype="Q4_0", n_embd=64, n_ff=256)
    sizes = tensor_bytes(model)
    q4 = frozenset({gguf.GGMLQuantizationType.Q4_0})
    repacked = sum(
        n
        for t, n in zip(gguf.GGUFReader(model).tensors, sizes.values(), strict=True)
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        and not t.name.startswith("token_embd")  # read by get_rows, not repacked
        and int(t.shape[1]) % 8 == 0  # the 8x8 layout takes rows by 8 (not the 354-row output)
    )
    weights = {
        flags: est(model, "-ngl", "0", *flags, repack=q4).system.weights
        for flags in [(), ("--no-mmap",), ("--no-repack",), ("-nr",)]
    }
    everything = sum(sizes.values())
    assert weights == {
        (): everything + repacked,
        ("--no-mmap",): everything,
        ("--no-repack",): everything,
        ("-nr",): everything,
    }
    assert est(model, "-ngl", "0", repack=NO_REPACK).system.weights == everything


def test_M1_host_repack_types_are_known_quant_types() -> None:
    assert host_repack_types() <= {
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.IQ4_NL,
        gguf.GGMLQuantizationType.Q2_K,
    }


def _moe(path: Path, *, tied: bool = False) -> Path:
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    tensors: dict[str, tuple[tuple[int, ...], gguf.GGMLQuantizationType]] = {
        "token_embd.weight": ((1000, 256), q8),
        "output_norm.weight": ((256,), f32),
    }
    if not tied:
        tensors["output.weight"] = ((1000, 256), q8)
    for il in range(2):
        tensors[f"blk.{il}.attn_q.weight"] = ((256, 256), q8)
        tensors[f"blk.{il}.ffn_gate_inp.weight"] = ((8, 256), f32)
        for part in ("up", "gate"):
            tensors[f"blk.{il}.ffn_{part}_exps.weight"] = ((8, 512, 256), q8)
        tensors[f"blk.{il}.ffn_down_exps.weight"] = ((8, 256, 512), q8)
    metadata = {
        "llama.block_count": 2,
        "llama.embedding_length": 256,
        "llama.attention.head_count": 4,
        "llama.context_length": 1024,
        "llama.expert_feed_forward_length": 512,
        "llama.expert_used_count": 2,
        "llama.expert_count": 8,
    }
    return write_gguf(path, metadata, tensors)


def test_M1_cpu_moe_and_override_tensor_keep_experts_on_the_cpu(tmp_path: Path) -> None:
    model = _moe(tmp_path / "moe.gguf")
    sizes = tensor_bytes(model)
    experts = {
        il: sum(n for k, n in sizes.items() if k.startswith(f"blk.{il}.") and "exps" in k)
        for il in (0, 1)
    }
    everything = sum(sizes.values())
    on_gpu = everything - sizes["token_embd.weight"]
    gpu = {
        flags: est(model, "-c", "1024", *flags).gpu.weights
        for flags in [
            (),
            ("--cpu-moe",),
            ("-cmoe",),
            ("--n-cpu-moe", "1"),
            ("-ot", r"blk\.1\.ffn_.*_exps=CPU"),
            ("-ngl", "0", "-ot", "exps=CUDA0"),
        ]
    }
    assert gpu == {
        (): on_gpu,
        ("--cpu-moe",): on_gpu - experts[0] - experts[1],
        ("-cmoe",): on_gpu - experts[0] - experts[1],
        ("--n-cpu-moe", "1"): on_gpu - experts[0],
        ("-ot", r"blk\.1\.ffn_.*_exps=CPU"): on_gpu - experts[1],
        ("-ngl", "0", "-ot", "exps=CUDA0"): experts[0] + experts[1],
    }


def test_M1_tied_embeddings_are_copied_to_the_gpu_with_the_output_layer(tmp_path: Path) -> None:
    model = _moe(tmp_path / "tied.gguf", tied=True)
    sizes = tensor_bytes(model)
    e = est(model, "-c", "1024")
    assert e.gpu.weights == sum(sizes.values())  # all but token_embd, plus token_embd's copy
    assert e.system.weights == sizes["token_embd.weight"]


def test_M1_moe_compute_uses_the_experts_a_token_goes_through(tmp_path: Path) -> None:
    model = _moe(tmp_path / "moe.gguf")
    e = est(model, "-c", "1024", "-ngl", "0", "-np", "1")
    ub, e_embd = 512, 256
    widest = 3 * (2 * 512) + 5 * e_embd  # 2 experts used x 512 each
    mask = 1024 * ub * 2
    # No tokenizer in this header: no output buffer or vocabulary to add.
    assert e.system.compute - RUNTIME_RSS == ub * 4 * widest + mask


# --- KV cache -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "cells"),
    [
        (["-c", "1000"], 1024),  # padded to 256
        (["-c", "4096"], 4096),
        (["-c", "0"], 2048),  # the model's context_length
        ([], 2048),
        (["-c", "100"], 256),
        (["-c", "3000", "-np", "3"], 3 * 1024),  # 3 streams of 1000, each padded
        (["-c", "1000", "-np", "3"], 3 * 512),
        (["-c", "3000", "-np", "3", "-kvu"], 3072),  # unified: one stream
        (["-np", "3"], 3 * 2048),  # no -c with slots: the model's context for each
        (["-np", "3", "--kv-unified"], 2048),
        (["--kv-unified-per-slot", "1000"], 4096),  # 4 auto slots x 1000 -> 4000 -> 4096
        (["-np", "2", "--kv-unified-per-slot", "1000"], 2 * 1024),
        (["-c", "2048", "-np", "2", "--kv-unified-per-slot", "1000"], 2048),
        (["--ctx-size=1500", "--parallel=1"], 1536),
    ],
)
def test_M1_kv_cells_follow_ctx_and_slots(tiny: Path, flags: list[str], cells: int) -> None:
    e = est(tiny, "-ngl", "0", *flags)
    assert e.system.kv == kv_bytes(cells, 4, EMBD)
    assert cells % KV_PAD == 0


@pytest.mark.parametrize(
    ("ctk", "ctv", "k", "v"),
    [
        ("f16", "f16", 2, 2),
        ("f32", "bf16", 4, 2),
        ("q8_0", "q4_0", 34 / 32, 18 / 32),
        ("q4_1", "iq4_nl", 20 / 32, 18 / 32),
        ("q5_0", "q5_1", 22 / 32, 24 / 32),
    ],
)
def test_M1_kv_cache_types(tiny: Path, ctk: str, ctv: str, k: float, v: float) -> None:
    e = est(tiny, "-ngl", "0", "-c", "2048", "-ctk", ctk, "--cache-type-v", ctv)
    assert e.system.kv == kv_bytes(2048, 4, EMBD, k, v)


def test_M1_kv_uses_the_kv_heads_of_grouped_query_attention(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "gqa.gguf", n_embd=128, n_head=8, n_head_kv=2, n_layer=3)
    e = est(model, "-ngl", "0", "-c", "1024")
    assert e.system.kv == kv_bytes(1024, 3, 2 * (128 // 8))


def test_M1_kv_per_layer_head_counts_and_head_sizes(tmp_path: Path) -> None:
    """Per-layer KV heads (0 = a layer without attention, as hybrid models have) and explicit
    key/value lengths."""
    f32 = gguf.GGMLQuantizationType.F32
    tensors = {"token_embd.weight": ((100, 64), f32)} | {
        f"blk.{il}.attn_norm.weight": ((64,), f32) for il in range(4)
    }
    metadata = {
        "llama.block_count": 4,
        "llama.embedding_length": 64,
        "llama.context_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": [4, 0, 2, 1],
        "llama.attention.key_length": 32,
        "llama.attention.value_length": 16,
    }
    model = write_gguf(tmp_path / "hybrid.gguf", metadata, tensors)
    e = est(model, "-ngl", "0")
    assert e.system.kv == 512 * (4 + 0 + 2 + 1) * (32 + 16) * 2


def test_M1_kv_follows_its_layer_unless_no_kv_offload(tiny: Path) -> None:
    layer = kv_bytes(2048, 1, EMBD)
    placed = {
        flags: (est(tiny, "-c", "2048", *flags).gpu.kv, est(tiny, "-c", "2048", *flags).system.kv)
        for flags in [(), ("-ngl", "3"), ("-nkvo",), ("--no-kv-offload",), ("-ngl", "0")]
    }
    assert placed == {
        (): (4 * layer, 0),
        ("-ngl", "3"): (2 * layer, 2 * layer),
        ("-nkvo",): (0, 4 * layer),
        ("--no-kv-offload",): (0, 4 * layer),
        ("-ngl", "0"): (0, 4 * layer),
    }


# --- compute ------------------------------------------------------------------------------


def compute(model: Path, *flags: str) -> int:
    e = est(model, "-ngl", "0", "-np", "1", *flags)
    return e.system.compute - RUNTIME_RSS - N_VOCAB * 4 - N_VOCAB * VOCAB_TOKEN_BYTES


def test_M1_compute_buffer_formula(tiny: Path) -> None:
    """The fitted formula: the widest stage per micro-batch token plus the f16 mask (flash
    attention) or the f32 scores of every head (without)."""
    widest = max(3 * FF + 5 * EMBD, 7 * EMBD)
    assert compute(tiny, "-c", "2048") == 512 * 4 * widest + 2048 * 512 * 2
    assert compute(tiny, "-c", "2048", "-fa", "on") == compute(tiny, "-c", "2048")
    assert compute(tiny, "-c", "2048", "-fa") == compute(tiny, "-c", "2048")  # bare, older builds
    no_fa = max(4 * widest + 4 * 2048, 2048 * (4 * HEADS + 4) + 32 * EMBD) * 512
    assert compute(tiny, "-c", "2048", "-fa", "off") == no_fa
    assert compute(tiny, "-c", "2048", "--flash-attn=off") == no_fa


def test_M1_compute_scales_with_the_micro_batch(tiny: Path) -> None:
    full = compute(tiny, "-c", "2048")
    assert compute(tiny, "-c", "2048", "-ub", "256") == full // 2
    assert compute(tiny, "-c", "2048", "-b", "256") == full // 2  # ubatch <= batch
    assert compute(tiny, "-c", "2048", "--ubatch-size", "1024", "-b", "4096") == full * 2
    widest = max(3 * FF + 5 * EMBD, 7 * EMBD)
    assert compute(tiny, "-c", "256") == 256 * 4 * widest + 256 * 256 * 2  # ubatch <= ctx


def test_M1_embeddings_reserve_every_tokens_logits(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "v.gguf", n_vocab=4000)
    e = est(model, "-ngl", "0", "-np", "1", "-c", "2048", "--embeddings")
    outputs = 4 * (4000 + EMBD)
    extra = RUNTIME_RSS + outputs + 4000 * VOCAB_TOKEN_BYTES
    assert e.system.compute - extra == 512 * 4 * (4000 + 6 * EMBD) + 2048 * 512 * 2


def test_M1_quantized_kv_adds_an_f16_view(tiny: Path) -> None:
    plain = compute(tiny, "-c", "2048")
    assert compute(tiny, "-c", "2048", "-ctk", "q8_0") == plain + 2048 * EMBD * 2


def test_M1_partial_offload_keeps_a_compute_buffer_on_each_side(tiny: Path) -> None:
    partial = est(tiny, "-c", "2048", "-ngl", "2")
    full = est(tiny, "-c", "2048", "-ngl", "99")
    assert partial.gpu.compute == full.gpu.compute
    assert partial.system.compute - full.system.compute == partial.gpu.compute - 512 * 4 * 2 * EMBD


def test_M1_system_part_holds_runtime_outputs_and_vocabulary(tiny: Path) -> None:
    e = est(tiny, "-c", "2048", "-ngl", "0")
    slots = 4  # -np auto
    outputs = slots * N_VOCAB * 4  # one row of logits per slot
    vocab = N_VOCAB * VOCAB_TOKEN_BYTES
    buffer = compute(tiny, "-c", "2048")
    assert e.system.compute == buffer + RUNTIME_RSS + outputs + vocab


# --- other files ------------------------------------------------------------------------------


def test_M1_mmproj_and_draft_models_are_counted(tmp_path: Path, tiny: Path) -> None:
    projector = write_tiny_gguf(tmp_path / "mmproj.gguf", n_layer=1)
    draft = write_tiny_gguf(tmp_path / "draft.gguf", n_layer=1)
    proj_bytes = sum(tensor_bytes(projector).values())
    base = est(tiny, "-c", "2048", "-ngl", "0")
    with_proj = est(tiny, "-c", "2048", "-ngl", "0", "--mmproj", str(projector))
    assert with_proj.files == (str(tiny), str(projector))
    assert with_proj.system.weights == base.system.weights + proj_bytes
    assert "the projector's image compute buffers are not counted" in with_proj.notes
    offloaded = est(tiny, "-c", "2048", "-mm", str(projector))
    assert offloaded.gpu.weights - est(tiny, "-c", "2048").gpu.weights == proj_bytes
    kept = est(tiny, "-c", "2048", "-mm", str(projector), "--no-mmproj-offload")
    assert kept.system.weights - est(tiny, "-c", "2048").system.weights == proj_bytes

    with_draft = est(tiny, "-c", "2048", "-ngl", "0", "-md", str(draft), "-ngld", "0")
    assert with_draft.files == (str(tiny), str(draft))
    draft_alone = est(draft, "-c", "2048", "-ngl", "0")
    assert with_draft.system.total == base.system.total + draft_alone.system.total - RUNTIME_RSS


def test_M1_relative_paths_resolve_against_cwd_and_placeholders_are_ignored(tiny: Path) -> None:
    argv = [LLAMA, f"--model={tiny.name}", "--host", "127.0.0.1", "--port", "${PORT}"]
    argv += ["-ngl", "0", "--device", "CUDA${GPU}"]
    e = estimate(argv, cwd=str(tiny.parent), repack_types=NO_REPACK)
    assert e == est(tiny, "-ngl", "0")
    assert e.files == (str(tiny),)


def test_M1_notes_say_where_the_context_came_from(tiny: Path) -> None:
    assert "ctx 2048 from the model's context_length" in est(tiny).notes
    assert "ctx 4096 from -c" in est(tiny, "-c", "4096").notes
    assert "ctx 6144 = 3 slots x the model's context_length 2048" in est(tiny, "-np", "3").notes
    assert "flash attention auto taken as on" in est(tiny).notes
    assert "flash attention auto taken as on" not in est(tiny, "-fa", "on").notes
    cram = "the prompt cache (--cache-ram) grows with use and is not counted"
    assert cram in est(tiny).notes
    assert cram not in est(tiny, "-cram", "0").notes


# --- the estimate object ------------------------------------------------------------------


def test_M1_usage_per_pool() -> None:
    e = Estimate(
        files=("/m.gguf",),
        gpu=Parts(100, 20, 10),
        system=Parts(5, 0, 30),
        cpu_only=Parts(105, 20, 40),
    )
    assert e.usage("gpu0") == {"gpu0": 130, "system": 35}
    assert e.usage(None) == {"system": 165}  # no GPU pool: the CPU-only run
    assert e.usage("gpu0", None) == {"gpu0": 130}
    assert e.usage(None, None) == {}
    bare = Estimate(files=("/m.gguf",), gpu=Parts(), system=Parts(5, 0, 30))
    assert bare.usage("gpu1") == {"system": 35}
    assert Estimate(("/m",), Parts(1, 2, 3), Parts(4, 5, 6)).usage(None) == {"system": 21}


def test_M1_describe_lists_parts_and_files() -> None:
    e = Estimate(
        files=("/models/a-00001-of-00002.gguf", "/models/a-00002-of-00002.gguf"),
        gpu=Parts(3 << 30, 512 << 20, 200 << 20),
        system=Parts(300 << 20, 0, 40 << 20),
        notes=("ctx 4096 from -c",),
    )
    assert e.describe() == (
        "gpu 3.70 GiB (weights 3.00 GiB, KV 512 MiB, compute 200 MiB); "
        "system 340 MiB (weights 300 MiB, KV 0, compute 40 MiB)\n"
        "from /models/a-00001-of-00002.gguf (+1 more); ctx 4096 from -c"
    )
    cpu = Estimate(files=("/m.gguf",), gpu=Parts(), system=Parts(1 << 20, 2048, 0))
    assert cpu.describe() == "system 1 MiB (weights 1 MiB, KV 2 KiB, compute 0)\nfrom /m.gguf"


# --- the header reader --------------------------------------------------------------------


def test_M1_header_reader_agrees_with_gguf_reader(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "q8.gguf", dtype="Q8_0", n_vocab=5000, n_head_kv=2)
    header = read_header(str(model))
    assert {t.name: t.n_bytes for t in header.tensors} == tensor_bytes(model)
    assert header.get("tokenizer.ggml.tokens") == Counted(5000)
    assert header.get("tokenizer.ggml.scores") == Counted(5000)  # long numeric: a count only
    assert header.integer("llama.attention.head_count_kv") == 2
    assert header.text("general.architecture") == "llama"


def test_M1_headers_are_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "m.gguf")
    first = read_header(str(model))
    assert read_header(str(model)) is first
    write_tiny_gguf(model, n_layer=3)  # rewritten: another size and mtime
    again = read_header(str(model))
    assert again is not first
    assert again.integer("llama.block_count") == 3
