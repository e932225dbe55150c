"""vLLM's compiled mode (its default, without enforce_eager) under hookscope's consent, compile policy
"hold_eager" (engines/vllm/compiled.py): a verb that needs module hooks is refused on a compiled engine
without it, the refusal naming both fixes; with it, the forwards that hold hookscope's requests run
uncompiled, so a capture and a steer equal hookscope's Hugging Face capture on the same checkpoint,
and a plain `llm.generate` after them runs compiled again.

Which forwards ran uncompiled is seen through a plain `register_forward_pre_hook` on the first decoder
layer, written here and installed in the worker: inside vLLM's compiled graph the layer's Python never
runs, so its count moves only on a forward that ran uncompiled.

One compiled engine for the module, in vLLM's default process layout (engine core and worker in
their own processes). Tolerance: float32, 1e-5 of the reference's largest value (assert_close).
What cannot be run here (a GPU's CUDA graphs, vLLM's stock torch.compile mode) is checked on the
settings alone: refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gate import need

need("vllm")
# the module's engine compiles at its start (inductor: minutes on a loaded 2-core box)
pytestmark = pytest.mark.slow

from vllm_models import assert_close, engine, hf_model, save, shut  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402
from hookscope.errors import EngineError, HookscopeError  # noqa: E402

POINT, STEERED, SCALE, NEW = "blocks.1.resid_post", "blocks.0.resid_post", 3.0, 4
LENGTHS = (5, 23, 48)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def compiled_llama(tmp_path_factory):
    directory = save("llama", tmp_path_factory.mktemp("llama"), seed=2)
    with pytest.MonkeyPatch.context() as patch:
        # the test's counting hook crosses to the worker as a function (vLLM pickles it only when told)
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = engine(directory, compile_policy="hold_eager", enable_prefix_caching=False, max_num_seqs=8)
        yield llm, hf_model(directory), directory
        shut(llm)


def layer_calls(llm) -> int:
    """Calls of the first decoder layer's Python forward in the worker so far (the counting hook
    installed on the first call)."""

    def count(worker) -> int:
        layer = worker.model_runner.get_model().model.layers[0]
        if "test_calls" not in worker.__dict__:
            calls = worker.test_calls = [0]
            layer.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
        return worker.test_calls[0]

    (calls,) = llm.collective_rpc(count)
    return calls


def plain_generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_refused_without_consent_naming_both_fixes(compiled_llama, monkeypatch):
    """The same compiled engine with the consent taken out of the caller's copy of its settings:
    every verb that needs module hooks is refused before any work."""
    llm, _, directory = compiled_llama
    config = llm.llm_engine.vllm_config
    monkeypatch.setattr(config, "additional_config", {})
    vector = torch.randn(256)
    verbs = {
        "hs.collect": lambda: hs.collect(llm, prompts(), POINT),
        "hs.generate": lambda: hs.generate(llm, prompts(), POINT, max_new_tokens=NEW),
        "hs.generate with an edit": lambda: hs.generate(
            llm, prompts(), edits=[hs.steer(STEERED, vector)], max_new_tokens=NEW
        ),
        # the path `vllm serve`'s plugin registers its named edits by
        "a named edit": lambda: hv.named_edit_call(config, "joy", hs.steer(STEERED, vector)),
        "extract on this engine": lambda: hs.extract(
            hs.ExtractConfig(out=str(directory / "never"), model=str(directory), points=[POINT], engine=llm)
        ),
    }
    for verb, call in verbs.items():
        with pytest.raises(EngineError) as refused:
            call()
        message = str(refused.value)
        assert "enforce_eager=True" in message, verb
        assert 'compile_policy="hold_eager"' in message and '"compile": "hold_eager"' in message, verb
    assert not (directory / "never").exists()
    # a run that would make its own compiled engine: refused before the engine starts
    made = hs.ExtractConfig(
        out=str(directory / "never"), model=str(directory), points=[POINT], engine="vllm",
        engine_args={"enforce_eager": False},
    )  # fmt: skip
    with pytest.raises(HookscopeError, match="compile_policy=hold_eager") as refused:
        hs.extract(made)
    assert "leave enforce_eager out" in str(refused.value)
    assert llm.collective_rpc("hookscope_hook_count") == [0]


def test_a_capture_runs_uncompiled_and_equals_hugging_face(compiled_llama):
    llm, hf, _ = compiled_llama
    before = layer_calls(llm)
    rows = hs.collect(llm, prompts(), [POINT, "blocks.0.attn.z"])
    assert layer_calls(llm) > before, "the hooked forwards ran compiled: the capture cannot be right"
    for prompt, got in zip(prompts(), rows, strict=True):
        want = hs.collect(hf, torch.tensor([prompt]), [POINT, "blocks.0.attn.z"])
        for point in (POINT, "blocks.0.attn.z"):
            assert_close(got[point], want[point][0], f"{len(prompt)} tokens, {point}")


def test_a_steer_and_its_capture_equal_hugging_face(compiled_llama):
    llm, hf, _ = compiled_llama
    steer = hs.steer(STEERED, torch.randn(256, generator=torch.Generator().manual_seed(5)), scale=SCALE)
    gens = hs.generate(llm, prompts(), POINT, edits=[steer], max_new_tokens=NEW)
    for prompt, got in zip(prompts(), gens, strict=True):
        want = hs.generate(
            hf, torch.tensor([prompt]), POINT, edits=[steer], max_new_tokens=NEW, do_sample=False
        )
        assert got.sequences.tolist() == want.sequences.tolist(), f"{len(prompt)} tokens"
        assert_close(got[POINT], want[POINT], f"{len(prompt)} tokens, steered {POINT}")
    n = len(prompts()[0])
    with torch.no_grad():
        plain = hs.collect(hf, torch.tensor([prompts()[0]]), POINT)[POINT]
    moved = (plain - gens[0][POINT][:, :n]).abs().max()
    assert moved > 1e-3, "the steer changed nothing: the test cannot tell"


def test_extraction_on_the_consented_engine_holds_hugging_faces_rows(compiled_llama, tmp_path):
    llm, _, directory = compiled_llama
    corpus = tmp_path / "corpus.txt"
    g = torch.Generator().manual_seed(4)
    words = "the a fox dog ran over under river stone light".split()
    corpus.write_text(
        "\n\n".join(
            " ".join(words[j] for j in torch.randint(0, 10, (40,), generator=g).tolist()) for _ in range(8)
        )
    )
    fields = {"model": str(directory), "points": [POINT], "data": str(corpus), "context": 32}
    fields.update(batch_size=4, dtype="float32", progress=False)
    hs.extract(hs.ExtractConfig(out=str(tmp_path / "served"), engine=llm, **fields))
    hs.extract(hs.ExtractConfig(out=str(tmp_path / "hf"), **fields))
    served, want = hs.open_store(tmp_path / "served"), hs.open_store(tmp_path / "hf")
    assert len(served) == len(want) > 4 * 32
    assert torch.equal(served.tensor("token_ids"), want.tensor("token_ids"))
    assert_close(served.tensor(POINT), want.tensor(POINT), f"{POINT}, vLLM store vs Hugging Face store")


def test_plain_generate_after_a_hooked_call_runs_compiled(compiled_llama):
    llm, _, _ = compiled_llama
    start = layer_calls(llm)
    hs.collect(llm, prompts(), POINT)
    hooked = layer_calls(llm)
    assert hooked > start  # the counter sees an uncompiled forward
    tokens = plain_generate(llm)
    assert all(len(t) == NEW for t in tokens)
    assert layer_calls(llm) == hooked, "a plain request's forward ran uncompiled after the hooked call"
    hs.collect(llm, prompts(), POINT)  # and the switch works again after it
    assert layer_calls(llm) > hooked


def test_compile_policy_names_are_checked():
    from hookscope.engines.vllm import compiled, serve

    with pytest.raises(EngineError, match='"off" .* or "hold_eager"'):
        compiled.engine_options("full", {})
    options = compiled.engine_options("hold_eager", {"additional_config": {"hookscope": {"vectors": "v"}}})
    assert options["enforce_eager"] is False
    assert options["additional_config"] == {"hookscope": {"vectors": "v", "compile": "hold_eager"}}
    assert compiled.engine_options("off", {})["enforce_eager"] is True
    flags = serve.serve_flags("v.safetensors", compile_policy="hold_eager")
    assert "--enforce-eager" not in flags
    assert '"compile": "hold_eager"' in flags[flags.index("--additional-config") + 1]
    assert "--enforce-eager" in serve.serve_flags("v.safetensors")


def engine_settings(mode: str, cudagraphs: str, consent: dict | None) -> SimpleNamespace:
    """A VllmConfig's fields the compile check reads (vLLM's enums by their names)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        additional_config={"hookscope": consent} if consent is not None else {},
        compilation_config=SimpleNamespace(
            mode=SimpleNamespace(name=mode), cudagraph_mode=SimpleNamespace(name=cudagraphs)
        ),
    )


@pytest.mark.parametrize(
    ("mode", "cudagraphs", "consent", "match"),
    [
        # a GPU's default: CUDA graphs replay without running the hooks, so consent is not enough
        (
            "VLLM_COMPILE",
            "FULL_AND_PIECEWISE",
            {"compile": "hold_eager"},
            "cudagraph_mode FULL_AND_PIECEWISE.*NONE",
        ),
        ("STOCK_TORCH_COMPILE", "NONE", {"compile": "hold_eager"}, "STOCK_TORCH_COMPILE.*enforce_eager=True"),
        ("VLLM_COMPILE", "NONE", {"compile": "full"}, "not a compile policy.*hold_eager"),
        ("VLLM_COMPILE", "NONE", None, "enforce_eager=True.*hold_eager"),
    ],
)
def test_what_the_switch_cannot_guarantee_is_refused(mode, cudagraphs, consent, match):
    from hookscope.engines.vllm import compiled

    with pytest.raises(EngineError, match=match):
        compiled.check(engine_settings(mode, cudagraphs, consent))
    assert not compiled.holds_eager(engine_settings(mode, cudagraphs, None))


def test_the_switch_is_held_where_it_works():
    from hookscope.engines.vllm import compiled

    for mode in ("DYNAMO_TRACE_ONCE", "VLLM_COMPILE"):
        settings = engine_settings(mode, "NONE", {"compile": "hold_eager", "vectors": "v.safetensors"})
        compiled.check(settings)
        assert compiled.holds_eager(settings)
