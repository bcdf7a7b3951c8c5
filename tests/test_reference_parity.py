"""Parity with the public reference implementation (`dflash==0.1.0`, test-only dependency).

Same weights (random, non-identity: convs, codebooks and transforms all active) in both models;
the reference runs its own single-block inference forward with SDPA, ours the block attention.
Tolerance: fp32, atol 2e-5 on hidden states (different but exact attention algorithms).
"""

from __future__ import annotations

import dflash.model as dflash_ref  # noqa: E402  (requirements-nodeps.txt)
import pytest
import torch

from dflash2.models.config import to_qwen3_config
from tests.draft_helpers import HIDDEN, VOCAB, random_draft, random_features, random_head


def reference_twin(ours):
    """The reference model class of the same architecture, holding our weights."""
    cls = getattr(dflash_ref, type(ours).__name__)
    ref = cls(to_qwen3_config(ours.config.to_dict())).eval()
    state = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in ours.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ref


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
@pytest.mark.parametrize("context_length", [3, 11])
def test_block_forward_and_greedy_proposal_match_reference(architecture, context_length):
    ours = random_draft(architecture, seed=11, output_multiplier=1.5, final_logit_softcapping=20.0)
    if architecture == "DFlashDraftModel":
        ours.config.dflash_config.pop("output_multiplier", None)
        ours.config.dflash_config.pop("final_logit_softcapping", None)
    ref = reference_twin(ours)
    head = random_head()
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    lm_head.weight.data.copy_(head.lm_head_weight)

    block_size = ours.block_size
    feats = random_features(context_length, seed=context_length)
    block_ids = torch.tensor([[17] + [ours.mask_token_id] * (block_size - 1)])
    emb = head.embed(block_ids)
    with torch.no_grad():
        want = ref(
            position_ids=torch.arange(context_length + block_size)[None],
            noise_embedding=emb,
            target_hidden=feats,
        )
        got = ours(emb[:, None], feats, torch.tensor([[context_length]]))[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)

    anchor = block_ids[:, 0]
    ours_tokens = ours.propose(got[:, 1:], anchor, head)[0]
    with torch.no_grad():
        if architecture == "DFlash2DraftModel":
            ref_tokens = ref.propose(want[:, 1:], anchor, lm_head, 0.0)[0]
        else:
            ref_tokens = ref.compute_logits(want[:, 1:], lm_head).argmax(-1)
    assert torch.equal(ours_tokens, ref_tokens)


def test_reference_unary_transforms_match():
    ours = random_draft(output_multiplier=0.7, final_logit_softcapping=5.0)
    ref = reference_twin(ours)
    head = random_head()
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    lm_head.weight.data.copy_(head.lm_head_weight)
    hidden = torch.randn(2, 3, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours.compute_logits(hidden, head), ref.compute_logits(hidden, lm_head))
