"""Extraction on the model's own continuations (`hookscope extract --generate N`): one packed batch
-> store rows of its kept prompt tokens and its generated ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from .driver import generate


def generate_rows(model: nn.Module, batch: Mapping[str, Tensor], points: Sequence[str], new_tokens: int,
                  keep: Tensor, *, dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu") -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One packed batch of `hookscope extract --generate N`: greedy-generate `new_tokens` after each
    sequence and return store rows, `{point: [rows, ...]}` and the per-row columns (token_ids,
    doc_ids, positions, seq_ids). Rows run sequence by sequence: its kept prompt tokens (`keep`,
    [batch, context]), then its generated tokens up to and including EOS. A continuation belongs
    to the last document of its sequence; its positions go on from that document's last token.
    Greedy decoding is deterministic, so a resumed extraction regenerates the same rows."""
    run_device = batch["input_ids"].device
    mask = batch["attention_mask"].bool().cpu()
    # packed rows are right-padded (if at all); a decoder continues after the last column
    order = torch.argsort((~mask).long() * -1, dim=1, stable=True)  # padding first, real tokens after
    left = {k: torch.gather(batch[k].cpu(), 1, order) for k in ("input_ids", "attention_mask", "doc_ids",
                                                                 "doc_positions")}
    keep = torch.gather(keep.cpu(), 1, order)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or 0
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    gen = generate(model, {"input_ids": left["input_ids"].to(run_device),
                           "attention_mask": left["attention_mask"].to(run_device)},
                   list(points), dtype=dtype, device=device, max_new_tokens=new_tokens,
                   min_new_tokens=0, do_sample=False, pad_token_id=pad)
    total_new = gen.sequences.shape[1] - gen.prompt_length
    rows_mask = torch.cat([keep.cpu(), gen.mask[:, gen.prompt_length:].cpu()], dim=1)
    steps = torch.arange(1, total_new + 1)
    # the last token of a document (not a separator / padding, whose doc id is -1)
    in_doc = left["doc_ids"] >= 0
    last = (in_doc.long() * torch.arange(in_doc.shape[1])).argmax(dim=1, keepdim=True)
    last_doc = torch.gather(left["doc_ids"], 1, last).expand(-1, total_new)
    last_pos = torch.gather(left["doc_positions"], 1, last) + steps
    acts = {name: value[rows_mask.to(value.device)] for name, value in gen.activations.items()}
    meta = {
        "token_ids": gen.sequences.cpu()[rows_mask],
        "doc_ids": torch.cat([left["doc_ids"], last_doc], dim=1)[rows_mask],
        "positions": torch.cat([left["doc_positions"], last_pos], dim=1)[rows_mask],
        "seq_ids": batch["seq_ids"].unsqueeze(1).expand_as(rows_mask)[rows_mask],
    }
    return acts, meta
