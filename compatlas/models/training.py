"""Train small attention-only transformers on data where induction pays, checkpoint by checkpoint.

The model is a Hugging Face Llama (rotary, RMSNorm; or GPT-2) whose MLPs are zeroed and
frozen, so it is attention-only; each checkpoint is saved with ``save_pretrained`` (plus an
offline word-level tokenizer) and enters the zoo like any local model, read through
transformer_lens's bridge.

Data (``induction_batch``): random tokens in which a span of random length repeats from a
random place on (``repeat``, the default) or is copied to a random later place (``copy``): the
repeats are predictable only by content, never by a fixed offset (see the functions).

Training is a chain of segments, one per checkpoint: the segment ending at step N resumes
the previous checkpoint's model and AdamW state. Batch s is drawn from a generator seeded by
(seed, s), so the chain is bitwise the run one long job would make, and adding a checkpoint
at the end trains only the new segment.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import polars as pl
import torch

from compatlas.progress import Progress
from compatlas.runtime import cpu_kernels, one_thread, stable_seed
from compatlas.tables import TRAINING_LOSS_SCHEMA

log = logging.getLogger(__name__)


def build_model(spec: dict[str, Any]):
    """An attention-only model: Llama-style (rotary positions, RMSNorm) by default, or GPT-2
    style (learned positions, LayerNorm); MLP weights zeroed and frozen (they then add 0).
    Rotary positions make "attend one token back" one relative offset to learn, rather than
    one per absolute position. Untied embeddings, no dropout, token 0 (the word-level
    tokenizer's ``t0``) as BOS and EOS."""
    from compatlas.models.small_models import ModelShape, small_hf_model

    arch = spec.get("architecture", "llama")
    # the MLPs are zeroed: Llama's are made 4 wide, GPT-2's keep their default width
    shape = ModelShape(arch, spec["n_layers"], spec["n_heads"], spec["d_head"], spec["d_vocab"],
                       n_ctx=max(spec["seq_len"] + 1, 64), d_mlp=4 if arch == "llama" else None)
    hf_config: dict[str, Any] = {"tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}
    if arch == "gpt2":
        hf_config.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        hf_config.update(pad_token_id=None)
    model = small_hf_model(shape, stable_seed(spec["seed"], "init"), **hf_config)
    mlps = [block.mlp for block in model.transformer.h] if arch == "gpt2" else [layer.mlp for layer in model.model.layers]
    for mlp in mlps:
        for p in mlp.parameters():
            p.data.zero_()
            p.requires_grad_(False)
    return model


def _optimizer(model, spec: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"],
                             weight_decay=spec["weight_decay"])


def induction_batch(spec: dict[str, Any], step: int) -> torch.Tensor:
    """The batch of training step ``step`` (1-based): ``[BOS]`` and ``seq_len`` tokens, drawn
    by ``spec["data"]`` (``repeat_batch`` or ``copy_batch``) from a generator seeded by
    (seed, step) alone."""
    g = torch.Generator().manual_seed(stable_seed(spec["seed"], "data", step))
    make = {"repeat": repeat_batch, "copy": copy_batch}[spec.get("data", "repeat")]
    x = make(spec, g)
    return torch.cat([torch.zeros(x.shape[0], 1, dtype=x.dtype), x], 1)


def repeat_batch(spec: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    """Random tokens up to a random start, then a random span of ``min_span``..``max_span``
    tokens repeated to the end. After its first occurrence every token is predictable by
    finding the current token earlier and reading the one after it: the canonical induction
    circuit. The period varies per sequence, so no fixed-offset head predicts it; with a
    vocabulary much larger than the period, one-token matches are unambiguous, which is what
    makes the model pick previous-token + induction heads over longer-context matching (with
    d_vocab 64 it grew heads at offsets 2-8 instead)."""
    B, N, V = spec["batch_size"], spec["seq_len"], spec["d_vocab"]
    x = torch.randint(1, V, (B, N), generator=g)  # 0 is BOS
    for i in range(B):
        k = int(torch.randint(spec["min_span"], spec["max_span"] + 1, (1,), generator=g))
        start = int(torch.randint(0, k, (1,), generator=g))
        x[i, start:] = x[i, start:start + k].repeat(N // k + 1)[: N - start]
    return x


def copy_batch(spec: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    """Random tokens in which ``copies`` spans of ``min_span``..``max_span`` tokens are each
    copied from a random place to a random later place. Only the copied tokens are
    predictable: a weaker signal than ``repeat_batch`` (induction heads form later, and not
    for every seed within a few thousand steps)."""
    B, N = spec["batch_size"], spec["seq_len"]
    x = torch.randint(1, spec["d_vocab"], (B, N), generator=g)  # 0 is BOS
    for i in range(B):
        for _ in range(spec.get("copies", 1)):
            k = int(torch.randint(spec["min_span"], spec["max_span"] + 1, (1,), generator=g))
            src = int(torch.randint(0, N - 2 * k + 1, (1,), generator=g))
            dst = int(torch.randint(src + k, N - k + 1, (1,), generator=g))
            x[i, dst:dst + k] = x[i, src:src + k]
    return x


def train_segment(spec: dict[str, Any], target_step: int, previous: Path | None, out_dir: Path,
                  model_id: str = "?") -> pl.DataFrame:
    """Train from the checkpoint in ``previous`` (None: a fresh model at step 0) to
    ``target_step``; save the model (``out_dir/hf_model``) and the resumable state
    (``out_dir/state.pt``); return the loss of every step of the segment."""
    from compatlas.models.small_models import word_tokenizer
    from compatlas.storage import atomic_path

    model = build_model(spec)
    opt = _optimizer(model, spec)
    step = 0
    if previous is not None:
        state = torch.load(previous / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    if step > target_step:
        raise ValueError(f"checkpoint {previous} is at step {step}, after the target step {target_step}")
    model.train()
    rows = []
    t0 = time.perf_counter()
    tokens_per_step = spec["batch_size"] * spec["seq_len"]
    progress = Progress(log, f"training {model_id}", total=target_step - step, unit="steps")
    log.info("training %s from step %d on CPU kernels %s", model_id, step, cpu_kernels())
    with one_thread():  # see one_thread: the run must not depend on the cores a job gets
        while step < target_step:
            step += 1
            x = induction_batch(spec, step)
            loss = model(x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()
            rows.append({"model": model_id, "step": step, "tokens": step * tokens_per_step, "loss": value})
            progress.advance()
            if step % 200 == 0 or step == target_step:
                log.info("step %d/%d loss %.3f (%.1fs)", step, target_step, value, time.perf_counter() - t0)
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {step}: lower training lr")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out_dir / "hf_model")
    word_tokenizer(spec["d_vocab"], out_dir / "hf_model")
    with atomic_path(out_dir / "state.pt") as tmp:  # written last: its presence means the checkpoint is whole
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    return pl.DataFrame(rows, schema=TRAINING_LOSS_SCHEMA)
