"""Tiny random checkpoints of every family hookscope's vLLM tables cover, saved with save_pretrained
(the path vLLM loads), and vLLM engines on them, for tests/engines/.

d_model 256 with 4 heads (head_dim 64: vLLM's CPU attention refuses 16), 2 layers, float32, every
parameter nudged off its initial value so that no two points are equal by accident (a norm weight
of exactly 1 would make ln2.normalized equal mlp.in and hide a wrong table entry).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from hookscope.testing import train_tokenizer

D_MODEL, N_HEADS, N_LAYERS = 256, 4, 2
# case -> (model type, config overrides)
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # vLLM's Gemma 2 has no lm_head of its own: it always ties it to the embedding. Its CPU attention
    # applies Gemma 2's logit soft cap (tanh, cap 50) its own way: with the cap on, attn.z and every
    # point after it differ from Hugging Face's by ~3e-4 of their largest value (measured 2026-12-07,
    # q / k / v still equal); the table is checked with the cap off
    "gemma2": (
        "gemma2",
        {"final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True},
    ),
    "gemma3": ("gemma3_text", {}),
    "gpt2": ("gpt2", {}),
}
# mixture-of-experts cases (test_vllm_moe.py): 4 experts, 2 per token; Qwen2-MoE with its shared expert
MOE_FAMILIES = {
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": D_MODEL // 2,
            "shared_expert_intermediate_size": D_MODEL,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": D_MODEL // 2},
    ),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
}

# a small KV cache (GiB): the default asks for a quarter of the machine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def config(kind: str, vocab: int, overrides: dict):
    from transformers import AutoConfig

    if kind == "gpt2":
        return AutoConfig.for_model(
            "gpt2", vocab_size=vocab, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=512
        )
    return AutoConfig.for_model(
        kind,
        vocab_size=vocab,
        hidden_size=D_MODEL,
        intermediate_size=2 * D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_HEADS // 2,
        head_dim=D_MODEL // N_HEADS,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        **{"tie_word_embeddings": False, **overrides},
    )


def save(case: str, directory: Path, seed: int = 0) -> Path:
    """The case's tiny checkpoint and tokenizer in `directory`."""
    from transformers import AutoModelForCausalLM

    kind, overrides = {**FAMILIES, **MOE_FAMILIES}[case]
    tok = train_tokenizer(512)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, len(tok), overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


# vLLM's engine core and worker in the process that makes the engine (read when it is made): no
# process spawned and no second and third import of vLLM and torch, the largest part of an engine's
# start on a CPU. The worker is still reached by name through LLM.collective_rpc and the rows still
# come back through the handoff file. vLLM's default layout (engine core and worker processes) is what
# test_vllm_requests.py and test_vllm_selections.py (vllm_shared.py), the served extraction's
# interrupted command, the server and docs/served.md run.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextlib.contextmanager
def in_this_process():
    """Engines made inside start in this process (IN_PROCESS)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in IN_PROCESS.items():
            patch.setenv(key, value)
        yield


def engine(directory: Path, *, in_process: bool = False, **kwargs):
    """A vLLM engine hookscope can read (hookscope.engines.vllm.llm), small and seeded; `in_process`:
    its engine core and worker in this process (IN_PROCESS)."""
    from hookscope.engines import vllm as hv

    with in_this_process() if in_process else contextlib.nullcontext():
        return hv.llm(str(directory), max_model_len=512, seed=0, **kwargs)


def through_the_serializer(llm) -> None:
    """An engine in this process whose `collective_rpc` sends its arguments and results through the
    msgpack serializer that carries them between the caller and the engine core in vLLM's default
    layout: what hookscope hands its workers (edits, steering vectors) must come through it whole."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    call = llm.collective_rpc

    def collective_rpc(method, timeout=None, args=(), kwargs=None):
        args, kwargs = decoder.decode(encoder.encode((args, kwargs or {})))
        return decoder.decode(encoder.encode(call(method, timeout=timeout, args=tuple(args), kwargs=kwargs)))

    llm.collective_rpc = collective_rpc


def shut(llm) -> None:
    """Stop the engine's core and worker processes now (not at interpreter exit). vLLM's own 5 s
    grace, not hookscope's `shut_down`: on a loaded box the core is then killed before it removes
    its shared memory, which the resource tracker removes at exit, but each engine's end is ~10 s
    sooner in a suite that starts many."""
    llm.llm_engine.engine_core.shutdown()


def hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    """Equal to `rel` of the reference's largest value (float32 sums in another order differ by
    ~1e-7 of it)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:g} x max |ref| {scale:.3g}"
