"""Selections on a vLLM engine: positions / heads / dtype on `hs.collect(llm, ...)` and
`hs.generate(llm, ...)` keep of each request what hookscope's Hugging Face verbs keep of that prompt
alone (row 0 of a batch of it), for requests of different lengths submitted together with chunked
prefill (64 tokens per forward: the long prompts' rows arrive in several forwards, shared with the
others). Positions are each request's own; the workers keep only the rows named (what crosses the
shared-memory handoff is checked); bad input is refused with Hugging Face's words.

Tolerance: float32, 1e-5 of the reference's largest value (vllm_models.assert_close); float16 rows
are the engine's float32 rows cast, byte for byte, and within one float16 step of Hugging Face's.
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402
from hookscope.engines.vllm.edits import describe_selection  # noqa: E402
from hookscope.selection import Selection  # noqa: E402

LENGTHS = (5, 40, 90, 150)
EVERY_BLOCK = ["blocks.*.resid_pre", "blocks.*.resid_mid", "blocks.*.resid_post", "blocks.*.mlp.out"]
HEADED = ["blocks.0.attn.z", "blocks.1.attn.z", "blocks.1.attn.q", "blocks.0.attn.k"]
NEW = 5


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def llama(default_layout_llama):
    """The llama test_vllm_requests.py shares (vllm_shared.start_default_layout_llama): in vLLM's
    default layout, the selections' descriptions and the rows' handoff cross its RPC."""
    return default_layout_llama.llm, hf_model(default_layout_llama.directory)


def hf_alone(hf, prompt: list[int], points, **selection) -> dict:
    got = hs.collect(hf, torch.tensor([prompt]), points, **selection)
    return {name: value[0] for name, value in got.items()}


def assert_like_hf_alone(llm, hf, points, **selection) -> list[dict]:
    together = hs.collect(llm, prompts(), points, **selection)
    for prompt, rows in zip(prompts(), together, strict=True):
        want = hf_alone(hf, prompt, points, **selection)
        assert set(rows) == set(want), (set(rows), set(want))
        for name in want:
            assert_close(rows[name], want[name], f"{name}, {len(prompt)} tokens, {selection}")
    return together


@pytest.mark.parametrize(
    "positions",
    [[-1], "last", -1, 0, [0, 3, -2, 3], slice(2, None, 7), slice(-4, None), torch.tensor([4, -5, 1])],
    ids=str,
)
def test_positions_of_each_request_equal_hugging_face_alone(llama, positions):
    llm, hf = llama
    together = assert_like_hf_alone(llm, hf, EVERY_BLOCK + ["blocks.0.attn.z"], positions=positions)
    assert len(together[0]) == 9  # every block's four points, and attn.z


def test_heads_and_positions_equal_hugging_face_alone(llama):
    llm, hf = llama
    assert_like_hf_alone(llm, hf, HEADED, heads=[1, 0])
    rows = assert_like_hf_alone(llm, hf, HEADED, heads=1, positions=[-1, 0])
    assert rows[0]["blocks.1.attn.z"].shape == (2, 1, 64)  # [positions, heads, d_head]


def test_float16_rows_are_the_cast_of_the_float32_rows(llama):
    llm, hf = llama
    points = ["blocks.1.resid_post", "blocks.0.attn.z"]
    full = hs.collect(llm, prompts(), points)
    half = hs.collect(llm, prompts(), points, dtype=torch.float16)
    for prompt, f32, f16 in zip(prompts(), full, half, strict=True):
        want = hf_alone(hf, prompt, points, dtype=torch.float16)
        for name in points:
            assert f16[name].dtype == torch.float16
            cast = f32[name].to(torch.float16)
            assert f16[name].view(torch.int16).equal(cast.view(torch.int16)), name  # bytes equal
            # Hugging Face's own float16 cast: its float32 rows differ by ~1e-7, a float16 step is 1e-3
            assert_close(f16[name], want[name], f"{name} float16 vs Hugging Face", rel=1e-3)


def test_the_workers_hand_back_only_the_rows_selected(llama):
    """What crosses the shared-memory handoff: one row per request for positions=[-1], the heads
    asked, float16 (not every row, cut at the caller)."""
    llm, _ = llama
    architecture, arch = hv.check_engine(llm)
    selection = Selection.of(positions=[-1], heads=[0, 2], dtype=torch.float16)
    _, rows = hv.run_requests(
        llm,
        architecture,
        [{"prompt_token_ids": p} for p in prompts()],
        [{"max_tokens": 1}] * len(LENGTHS),
        ["blocks.0.attn.z"],
        {},
        selection=describe_selection(selection),
    )
    for i in range(len(LENGTHS)):
        handed = rows[i]["blocks.0.attn.z"]
        assert handed.shape == (1, 2, 64) and handed.dtype == torch.float16


def test_generate_keeps_what_hugging_face_generate_keeps(llama):
    """hs.generate on the engine with positions (counted over each final sequence, from its end too),
    heads and dtype, against Hugging Face's hs.generate of each prompt alone."""
    llm, hf = llama
    for selection in ({"positions": [0, -1, 2], "heads": [1, 0]}, {"positions": "last"}):
        got = hs.generate(llm, prompts(), HEADED, max_new_tokens=NEW, **selection)
        for prompt, gen in zip(prompts(), got, strict=True):
            want = hs.generate(
                hf, torch.tensor([prompt]), HEADED, max_new_tokens=NEW, do_sample=False, **selection
            )
            assert gen.sequences.tolist() == want.sequences.tolist()
            for name in HEADED:
                assert_close(gen[name], want[name], f"generate {name}, {len(prompt)} tokens, {selection}")
    plain = hs.generate(llm, prompts()[:2], HEADED, max_new_tokens=NEW)
    half = hs.generate(llm, prompts()[:2], HEADED, max_new_tokens=NEW, dtype=torch.float16)
    for f32, f16 in zip(plain, half, strict=True):
        for name in HEADED:
            assert f16[name].dtype == torch.float16 and f16[name].equal(f32[name].to(torch.float16))


def hf_error(hf, points, **selection) -> str:
    with pytest.raises(hs.SelectionError) as caught:
        hs.collect(hf, torch.tensor([prompts()[0]]), points, **selection)
    return str(caught.value)


@pytest.mark.parametrize(
    "points, selection",
    [
        ("blocks.0.resid_post", {"positions": "first"}),
        ("blocks.0.resid_post", {"positions": slice(0, None, -1)}),
        ("blocks.0.attn.z", {"heads": [0.5]}),
        ("blocks.0.resid_post", {"dtype": "float16"}),
        ("blocks.0.resid_post", {"heads": [1]}),  # a point without heads
    ],
    ids=str,
)
def test_bad_selections_are_refused_before_work_in_hugging_face_words(llama, monkeypatch, points, selection):
    llm, hf = llama
    words = hf_error(hf, points, **selection)

    def ran(*args, **kwargs):
        raise AssertionError("the engine ran")

    monkeypatch.setattr(llm, "generate", ran)
    with pytest.raises(hs.SelectionError) as caught:
        hs.collect(llm, prompts(), points, **selection)
    assert str(caught.value) == words
    with pytest.raises(hs.SelectionError) as caught:
        hs.generate(llm, prompts(), points, max_new_tokens=2, **selection)
    assert str(caught.value) == words


@pytest.mark.parametrize(
    "points, selection",
    [("blocks.0.resid_post", {"positions": [7]}), ("blocks.0.attn.z", {"heads": [5]})],
    ids=str,
)
def test_selections_outside_a_request_are_refused_and_the_engine_goes_on(llama, points, selection):
    """Positions past a prompt, heads past a point: known only where the rows are (the workers), so
    refused once the engine has run, with Hugging Face's words; the engine is left as it was."""
    llm, hf = llama
    words = hf_error(hf, points, **selection)  # prompt 0 has 5 tokens, attn.z 4 heads
    with pytest.raises(hs.SelectionError) as caught:
        hs.collect(llm, prompts(), points, **selection)
    assert words in str(caught.value)
    assert llm.collective_rpc("hookscope_hook_count") == [0]
    (rows,) = hs.collect(llm, prompts()[:1], "blocks.0.resid_post", positions=[-1])
    assert rows["blocks.0.resid_post"].shape == (1, 256)


def test_a_token_mask_is_refused_on_an_engine(llama):
    llm, _ = llama
    with pytest.raises(hs.EngineError, match="takes no token_mask"):
        hs.collect(llm, prompts(), "blocks.0.resid_post", token_mask=torch.ones(1, 5, dtype=torch.bool))


def test_a_selection_naming_no_position_of_a_prompt_is_refused(llama):
    """Hugging Face gives an empty tensor; the engine hands back no empty rows, and says so."""
    llm, _ = llama
    with pytest.raises(
        hs.SelectionError, match=r"prompt 0 \(5 tokens\): the positions name none of its tokens"
    ):
        hs.collect(llm, prompts(), "blocks.0.resid_post", positions=slice(10, None))
