"""compatlas.function.split_forks: a fork no hook touches normed once gives the very bits of the
bridge's per-head norm (exact patching and EAP), and the bridge is restored after."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_hf_model

from compatlas.behaviour.sequences import TokenSet
from compatlas.function import split_forks
from compatlas.function.edge_attribution import (
    attribution_scores,
    causal_edges,
    exact_scores,
    induction_task,
    split_inputs,
)
from compatlas.models.loading import boot
from compatlas.models.small_models import word_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 16


@pytest.fixture(scope="module", params=["llama-gqa", "gpt2", "gemma3"])
def model(request, tmp_path_factory):
    """A random tiny model in float32 (the pipeline's dtype): Llama-style with 2 KV heads for 4
    query heads (RMSNorm), GPT-2 (LayerNorm, joint QKV), Gemma 3 (QK-norm, sandwich norms)."""
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    tiny_hf_model(request.param, V).save_pretrained(folder)
    word_tokenizer(V, folder)
    bridge, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder, dtype=torch.float32)
    return bridge.eval()


def _patched(model) -> list:
    return [m for m in model.modules() if split_forks.METHOD in vars(m)]


def test_exact_and_eap_are_bitwise_those_of_the_per_head_norm(model, monkeypatch):
    task = induction_task(TokenSet(pool=torch.arange(V)), 4, 6, seed=2)
    edges = causal_edges(model)
    shared = []
    own = split_forks._shared

    def counted(method):  # how many forks took the shortcut
        fork = own(method)

        def call(source, hook, n_heads):
            shared.append(n_heads > 1 and not split_forks._hooked(hook))
            return fork(source, hook, n_heads)
        return call

    monkeypatch.setattr(split_forks, "_shared", counted)
    new = exact_scores(model, task, edges, batch_size=32), attribution_scores(model, task, "eap", batch_size=4)
    assert any(shared) and not all(shared)  # unhooked forks shared, the patched reader's fork its own
    assert not _patched(model)
    monkeypatch.setattr(split_forks, "DISABLED", True)
    old = exact_scores(model, task, edges, batch_size=32), attribution_scores(model, task, "eap", batch_size=4)
    assert new[0].abs().max() > 1e-5
    assert torch.equal(new[0], old[0])
    assert all(torch.equal(new[1][c], old[1][c]) for c in old[1])


def test_a_hooked_fork_is_the_bridges_own_and_the_bridge_is_restored(model):
    """The hook sees H distinct copies to patch; leaving, even by an exception, restores the bridge."""
    seen = {}

    def look(x, hook):
        seen[hook.name] = x.shape
        return x

    with split_inputs(model):
        with pytest.raises(RuntimeError), split_forks.shared_forks(model):
            patched = _patched(model)
            with split_forks.shared_forks(model):  # nested: a no-op
                assert _patched(model) == patched
            model.run_with_hooks(torch.arange(6)[None], fwd_hooks=[("blocks.1.attn.hook_q_input", look)])
            raise RuntimeError
    assert len(patched) == model.cfg.n_layers and not _patched(model)
    assert seen == {"blocks.1.attn.hook_q_input": (1, 6, model.cfg.n_heads, model.cfg.d_model)}


def test_a_model_without_the_forks_runs_unchanged(caplog, monkeypatch):
    monkeypatch.setattr(split_forks, "_warned", [])
    with caplog.at_level(logging.INFO, logger=split_forks.__name__), split_forks.shared_forks(torch.nn.Linear(2, 2)):
        pass
    with split_forks.shared_forks(torch.nn.Linear(2, 2)):
        pass
    assert len([r for r in caplog.records if "normalised per head" in r.getMessage()]) == 1
