"""The vLLM executor (`--engine vllm`): the extraction loop's fourth executor, beside `InMemory`
(loop.py's `Executor` is the seam). It sends each batch's sequences, unpadded, to a vLLM engine as
requests (`hookscope.engines.vllm.collect`: captured in the engine's workers, every request's rows
equal to it run alone) and keeps the rows the in-memory executor keeps, in its order and dtype, so
the store is the same store; resume, signals, progress and the non-finite check stay the loop's.

The engine is made for the run (`hookscope.engines.vllm.llm`, from the model's local directory,
`ExtractConfig.engine_args` added) when the run first needs it, after the store's settings were
checked, and shut down at the end; or it is the `vllm.LLM` given as `ExtractConfig.engine`, which
stays up. The model here is built on `meta` (no weight read): it gives the source its tokenizer and
the store the model's identity, the same as a Hugging Face extraction of the same checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..engines import vllm as hv
from ..engines.vllm import compiled, tables
from ..errors import EngineDied, EngineError, HookscopeError
from ..extract_config import ExtractConfig, Run
from ..loading import Loaded
from ..one_thread import one_thread
from ..sources import Batches, Rows, Source, TextSource
from ..sources.base import Call
from .lending import Lender

# engine options the run sets itself: the model it reads, and the worker extension hookscope captures with
SET_BY_THE_RUN = ("model", "worker_extension_cls")


def check_config(cfg: ExtractConfig, kind: type[Source]) -> None:
    """Refuse what the vLLM executor cannot run, before anything is loaded."""
    if isinstance(cfg.engine, str):
        if cfg.engine != "vllm":
            raise HookscopeError(f"--engine {cfg.engine!r}: the one engine is vllm; or leave --engine out")
        if cfg.model is None:
            raise HookscopeError("--engine vllm reads the model from its local directory: give MODEL")
        hv.check_version()  # vLLM installed, a release the tables were checked on
        _check_engine_args(cfg.engine_args)
    else:
        hv.check_engine(cfg.engine)  # a given vllm.LLM that hookscope can read
        if cfg.engine_args:
            raise HookscopeError(
                "engine_args are the options of an engine made for the run: the given vllm.LLM already "
                "has its own; leave engine_args out"
            )
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise HookscopeError(
            "--engine vllm runs in one process (vLLM spreads the model over devices itself): "
            "run it without torchrun"
        )
    if not issubclass(kind, TextSource):
        raise HookscopeError(
            f"--engine vllm extracts text; {cfg.data!r} is read by {kind.__name__}: leave --engine out"
        )


def _check_engine_args(engine_args: dict[str, Any]) -> None:
    for key in SET_BY_THE_RUN:
        if key in engine_args:
            raise HookscopeError(f"--engine-arg {key}: the run sets it itself; leave it out")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if engine_args.get(key, 1) != 1:
            raise HookscopeError(
                f"--engine-arg {key}={engine_args[key]}: extraction on a parallel vLLM engine is not "
                f"supported yet (its column-parallel points are per-rank shards); leave {key} out"
            )
    consented = engine_args.get("compile_policy") == compiled.HOLD_EAGER
    if engine_args.get("enforce_eager", True) is not True and not consented:
        raise HookscopeError(
            "--engine-arg enforce_eager=false: module hooks do not run inside vLLM's compiled graph; "
            "leave enforce_eager out, or consent to hookscope running the batches' forwards uncompiled "
            f"with --engine-arg compile_policy={compiled.HOLD_EAGER}"
        )
    # (an unknown compile_policy is refused here, before the engine starts)
    compiled.engine_options(engine_args.get("compile_policy", "off"), {})


def model_dir(cfg: ExtractConfig) -> str:
    """Where the run's model is read from: MODEL, or the given engine's model."""
    if isinstance(cfg.engine, str):
        return cfg.model
    served = cfg.engine.llm_engine.vllm_config.model_config.model
    if cfg.model is not None and os.path.realpath(cfg.model) != os.path.realpath(served):
        raise HookscopeError(
            f"model {cfg.model!r} is not the given engine's model ({served!r}): leave model out, or give "
            "an engine made from it"
        )
    return served if cfg.model is None else cfg.model  # as given: the store's settings name it so


class VllmEngine:
    """Runs this rank's batches through a vLLM engine, as many sequences per engine call as the
    engine schedules at once (`max_num_seqs`), so that its continuous batching stays full; each
    batch's rows are yielded in index order as soon as its call returns."""

    def __init__(
        self,
        source: Source,
        loaded: Loaded,
        points: Sequence[str],
        dtype: torch.dtype,
        run: Run,
        cfg: ExtractConfig,
    ):
        self.source, self.points, self.dtype, self.run_on = source, list(points), dtype, run
        self.model_dir, self.given = model_dir(cfg), None if isinstance(cfg.engine, str) else cfg.engine
        context = source.item_tokens()
        # a request is its prompt and the one token vLLM samples after it
        self.engine_args = {"max_model_len": context + 1, "enable_prefix_caching": False, **cfg.engine_args}
        config = loaded.model.config
        architecture = (getattr(config, "architectures", None) or [type(loaded.model).__name__])[0]
        # a point vLLM's model class lacks, or its kernels never expose, is refused before the engine starts
        hv.resolve(tables.table(architecture, config), self.points)
        if self.given is not None:
            longest = self.given.llm_engine.vllm_config.model_config.max_model_len
            if longest < context + 1:
                raise EngineError(
                    f"the given engine's max_model_len {longest} is shorter than a sequence of "
                    f"--context {context} and its one sampled token: make it with "
                    f"max_model_len >= {context + 1}"
                )

    def run(
        self, batches: Batches, *, lender: Lender | None = None, on_stage: Callable[[str], None] | None = None
    ) -> Iterator[tuple[int, dict[str, Tensor], Rows]]:
        engine = self.given
        if engine is None:
            if on_stage is not None:
                on_stage("starting the vLLM engine")
            engine = hv.llm(self.model_dir, **self.engine_args)
        try:
            per_call = engine.llm_engine.vllm_config.scheduler_config.max_num_seqs
            pending = iter(batches)
            while chunk := _chunk(pending, per_call, self.source):
                sequences = [_sequences(call) for _, _, call in chunk]
                sent = [ids for batch_sequences in sequences for ids in batch_sequences if ids]
                captured = iter(hv.collect(engine, sent, self.points) if sent else ())
                for (index, batch, call), batch_sequences in zip(chunk, sequences, strict=True):
                    per_sequence = [next(captured) if ids else None for ids in batch_sequences]
                    acts = self._kept(call, per_sequence)
                    yield index, batch, self.source.rows_of(batch, call, acts)
        except EngineDied as death:
            raise EngineDied(
                death.what,
                "the store keeps every whole batch written before it: run the same command to resume",
            ) from None
        finally:
            if self.given is None:
                hv.shut_down(engine)  # its core and workers, now

    def _kept(self, call: Call, per_sequence: list) -> dict[str, Tensor]:
        """The rows the in-memory executor keeps: each sequence's kept tokens, row-major, cast. One
        gather per point, on this thread alone: the forward runs in the engine's processes, against
        which torch's intra-op threads would only spin (one_thread.py)."""
        mask = call.inputs["attention_mask"].bool()
        keep = mask if call.keep is None else call.keep.bool()
        # the kept tokens' places among the batch's real tokens, row-major: the order of the engine's rows
        kept = keep[mask].nonzero().squeeze(1)
        captured = [rows for rows in per_sequence if rows is not None]
        with one_thread():
            return {
                name: torch.cat([rows[name] for rows in captured]).index_select(0, kept).to(self.dtype)
                for name in self.points
            }


def _sequences(call: Call) -> list[list[int]]:
    """Each row's real tokens, as the source gives them (padding left out)."""
    ids, mask = call.inputs["input_ids"], call.inputs["attention_mask"].bool()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


def _chunk(pending: Iterator, sequences: int, source: Source) -> list[tuple[int, dict, Call]]:
    """The next batches, each with its `Call`, until they hold `sequences` sequences or run out."""
    chunk, count = [], 0
    for index, batch in pending:
        call = source.call_of(batch)
        chunk.append((index, batch, call))
        count += call.inputs["input_ids"].shape[0]
        if count >= sequences:
            break
    return chunk
