"""Speculative decoding against a tiny random Qwen3 target: exactness (greedy), losslessness (sampling),
acceptance-length bookkeeping, and the CLI outputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash2 import decode
from dflash2 import evaluate as ev
from dflash2.models import TargetHead, build_draft
from tests.draft_helpers import plain_greedy, randomize_, tiny_draft_config
from tests.run_helpers import REPO

HIDDEN, NUM_LAYERS = 64, 4
PROMPT = [5, 17, 42, 8, 99, 3, 250, 61]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build_target(
    vocab_size: int = 300, seed: int = 0, logit_scale: float = 1.0, num_layers: int = NUM_LAYERS
) -> Qwen3ForCausalLM:
    """A random Qwen3 target; `logit_scale` sharpens its next-token distributions."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(config).eval()
    randomize_(target, seed=seed, scale=0.2)
    with torch.no_grad():
        target.lm_head.weight.mul_(logit_scale)
    return target


def build_hybrid_target(vocab_size: int, seed: int = 0):
    """A random Qwen3.5 hybrid target: a Gated DeltaNet layer (conv + recurrent state), then attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return randomize_(Qwen3_5ForCausalLM(config).eval(), seed=seed, scale=0.2)


def build_random_draft(
    architecture: str,
    vocab_size: int = 300,
    block_size: int = 4,
    seed: int = 3,
    top_k: int = 4,
    target_layer_ids: tuple[int, ...] = (0, 2, 3),
    num_layers: int = 2,
):
    num_target_layers = max(target_layer_ids) + 1
    cfg = tiny_draft_config(architecture, block_size=block_size, target_layer_ids=list(target_layer_ids))
    cfg["vocab_size"], cfg["num_target_layers"], cfg["num_hidden_layers"] = (
        vocab_size,
        num_target_layers,
        num_layers,
    )
    cfg["layer_types"] = cfg["layer_types"][-num_layers:]
    cfg["dflash_config"]["mask_token_id"] = vocab_size - 1
    cfg["dflash_config"]["num_target_layers"] = num_target_layers
    if architecture == "DFlash2DraftModel":
        cfg["dflash_config"]["selector_top_k"] = top_k
    return randomize_(build_draft(cfg), seed=seed).eval()


@pytest.fixture(scope="module")
def target():
    return build_target()


@pytest.fixture(scope="module")
def head(target):
    return TargetHead.from_target(target)


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_greedy_output_equals_target_greedy(target, head, architecture):
    draft = build_random_draft(architecture)
    result = decode.speculative_generate(draft, target, head, PROMPT, max_new_tokens=40)
    assert result.output_ids == plain_greedy(target, PROMPT, 40)
    # Bookkeeping: every token but the prefill one is committed by a verify step.
    assert sum(result.acceptance_lengths) + 1 == len(result.output_ids) == 40
    assert result.num_target_forwards == 1 + len(result.acceptance_lengths)
    assert all(1 <= t <= draft.block_size for t in result.acceptance_lengths)
    assert result.stop_reason == "max_new_tokens"


def test_stop_token_ends_generation(target, head):
    draft = build_random_draft("DFlash2DraftModel")
    reference = plain_greedy(target, PROMPT, 30)
    stop = reference[12]
    first = reference.index(stop)
    result = decode.speculative_generate(
        draft, target, head, PROMPT, max_new_tokens=30, stop_token_ids=[stop]
    )
    assert result.output_ids == reference[: first + 1]
    assert result.stop_reason == "stop_token"
    assert (
        decode.target_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=[stop])
        == reference[: first + 1]
    )


def test_untrained_draft_accepts_almost_nothing(target, head):
    # A freshly built draft (identity convs, zero successor codebook) has no idea of the target:
    # observed tau = 1.0 here (vocab 300); anything above 1.3 would mean the verifier accepts wrong tokens.
    cfg = tiny_draft_config("DFlash2DraftModel", block_size=4, target_layer_ids=[0, 2, 3])
    cfg["vocab_size"], cfg["num_target_layers"] = 300, NUM_LAYERS
    cfg["dflash_config"].update(mask_token_id=299, num_target_layers=NUM_LAYERS)
    torch.manual_seed(0)
    draft = build_draft(cfg).eval()
    result = decode.speculative_generate(draft, target, head, PROMPT, max_new_tokens=60)
    assert result.mean_acceptance_length < 1.3


def test_oracle_draft_gets_full_blocks(target, head, monkeypatch):
    """A draft whose proposals are the target's own greedy continuation commits B tokens per step
    (the last step only as many as max_new_tokens leaves)."""
    draft = build_random_draft("DFlash2DraftModel", block_size=4)
    reference = plain_greedy(target, PROMPT, 40)
    produced = len(PROMPT)  # position of the anchor in PROMPT + reference

    def oracle_block(draft, head, context, anchor, temperature=0.0, generator=None):
        start = context.length + 1 - len(PROMPT)  # index in `reference` of the slot after the anchor
        assert reference[start - 1] == anchor
        nonlocal produced
        produced = context.length
        padded = reference[start : start + draft.block_size - 1] + [0] * draft.block_size
        return torch.tensor(padded[: draft.block_size - 1]), None, torch.ones(draft.block_size - 1, 300) / 300

    monkeypatch.setattr(decode, "draft_block", oracle_block)
    result = decode.speculative_generate(draft, target, head, PROMPT, max_new_tokens=40)
    assert result.output_ids == reference
    # 1 prefill token + 9 full blocks of 4 = 37; the 10th step keeps the 3 tokens left.
    assert result.acceptance_lengths == [4] * 9 + [3]
    assert result.accepted_proposals == [3] * 10  # the last step accepted all three; the limit cut it
    assert result.clean_block_tokens == 39
    summary = ev.summarize([result], draft.block_size)
    assert summary["position_acceptance_rate"] == {"1": 1.0, "2": 1.0, "3": 1.0}
    assert summary["acceptance_histogram"] == {"1": 0, "2": 0, "3": 1, "4": 9}
    assert produced == len(PROMPT) + 36  # the draft always saw the features of every committed position


def test_a_draft_of_another_target_is_refused_with_what_differs(target, tiny_default, tmp_path):
    """The vocabularies agree; the depth does not (a draft that would run, reading the wrong layers)."""
    from dflash2.export import export_draft

    draft = build_random_draft("DFlash2DraftModel")  # reads target layers 0, 2, 3 of 4
    export_draft(draft, tmp_path / "fits", dtype=torch.float32, target_config=target.config)
    assert ev.load_draft_for(target, tmp_path / "fits").config.num_target_layers == NUM_LAYERS
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    cfg = json.loads((tmp_path / "fits" / "config.json").read_text())
    cfg["num_target_layers"] = cfg["dflash_config"]["num_target_layers"] = NUM_LAYERS + 2
    (deeper / "config.json").write_text(json.dumps(cfg))
    (deeper / "model.safetensors").write_bytes((tmp_path / "fits" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"does not fit the target: num_target_layers={NUM_LAYERS + 2} but"):
        ev.load_draft_for(target, deeper)
    # and against the tokenizer: a mask token other than its own (refused by training and export --check,
    # where evaluation decoded with it)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    cfg = json.loads((tmp_path / "fits" / "config.json").read_text())
    for mask in (mask_id, mask_id + 1):
        cfg["dflash_config"].update(mask_token_id=mask, mask_token=None)
        (deeper / "config.json").write_text(json.dumps(cfg))
        if mask == mask_id:
            ev.load_draft_for(target, deeper, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=f"mask_token_id={mask_id + 1}.*deeper/config.json.*trained for"):
        ev.load_draft_for(target, deeper, tokenizer=tokenizer)


def test_prompt_lookup_proposal_copies_what_followed_the_latest_match():
    assert ev.prompt_lookup_proposal([1, 2, 3, 1, 2], 3, 4, 1) == [3, 1, 2]  # "1 2" recurs: copy on
    assert ev.prompt_lookup_proposal([5, 1, 9, 1, 8, 1], 3, 4, 1) == [8, 1, 8]  # the latest "1"
    assert ev.prompt_lookup_proposal([4, 7, 7], 3, 4, 1) == [7, 7, 7]  # a repeating span repeats
    # what followed the latest earlier "2"
    assert ev.prompt_lookup_proposal([6, 2, 9, 6, 2, 5, 2], 2, 4, 1) == [5, 2]
    assert ev.prompt_lookup_proposal([6, 2, 9, 6, 2, 5, 2], 2, 4, 2) == []  # no 2-gram recurs
    assert ev.prompt_lookup_proposal([1, 2, 3], 3, 4, 1) == []


def test_prompt_lookup_tau_is_what_a_lookup_proposer_gets_from_the_verification_loop(monkeypatch):
    """prompt_lookup_acceptance (from the target's greedy tokens alone) equals the acceptance
    lengths of the real speculative decoding loop with prompt lookup as its proposer, on a small
    random target whose greedy output repeats (steps of 1 to 4 tokens, a last step cut short)."""
    vocab, prompt = 32, [5, 17, 12, 8, 29, 3, 25, 11]
    target = build_target(vocab_size=vocab, seed=1)
    head = TargetHead.from_target(target)
    draft = build_random_draft("DFlashDraftModel", vocab_size=vocab, block_size=4)
    reference = plain_greedy(target, prompt, 40)
    unused = next(t for t in range(vocab) if t not in reference)  # a proposal the target rejects

    def lookup_block(draft, head, context, anchor, temperature=0.0, generator=None):
        sequence = prompt + reference[: context.length + 1 - len(prompt)]
        assert sequence[-1] == anchor
        proposal = ev.prompt_lookup_proposal(sequence, draft.block_size - 1, *ev.PROMPT_LOOKUP_NGRAM)
        tokens = (proposal or [unused] * (draft.block_size - 1))[: draft.block_size - 1]
        return torch.tensor(tokens), None, torch.ones(draft.block_size - 1, vocab) / vocab

    monkeypatch.setattr(decode, "draft_block", lookup_block)
    result = decode.speculative_generate(draft, target, head, prompt, max_new_tokens=40)
    assert result.output_ids == reference
    expected = ev.prompt_lookup_acceptance(prompt, reference, block_size=4)
    assert result.acceptance_lengths == expected
    assert {1, 2, 3, 4} <= set(expected) and sum(expected) == 39  # the first token is the prefill's
    summary = ev.prompt_lookup_summary([prompt], [decode.TargetResult(reference, 1.0)], 4)
    loop = result.acceptance_lengths
    assert summary["prompt_lookup_tau"] == pytest.approx(sum(loop) / len(loop))


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_cached_draft_proposes_what_the_full_forward_proposes(target, head, architecture, monkeypatch):
    """The draft's context cache changes no proposal: at every step of a 60-token generation
    (sliding window 6 in layer 0, so the cache drops positions), the proposals equal those of the
    draft's forward over the features of every committed position, token for token."""
    draft = build_random_draft(architecture)
    assert draft.layers[0].self_attn.sliding_window == 6
    features, steps = [], []
    extend_context, draft_block = draft.extend_context, decode.draft_block

    def recording_extend(cache, new_features):
        features.append(new_features)
        extend_context(cache, new_features)

    def recording_block(draft, head, context, anchor, *args):
        tokens, candidates, q = draft_block(draft, head, context, anchor, *args)
        steps.append((torch.cat(features, dim=1), anchor, tokens.tolist()))
        return tokens, candidates, q

    monkeypatch.setattr(draft, "extend_context", recording_extend)
    monkeypatch.setattr(decode, "draft_block", recording_block)
    result = decode.speculative_generate(draft, target, head, PROMPT, max_new_tokens=60)
    assert len(steps) == len(result.acceptance_lengths) >= 15
    for prefix, anchor, tokens in steps:
        block_ids = torch.tensor([[anchor] + [draft.mask_token_id] * (draft.block_size - 1)])
        with torch.no_grad():
            hidden = draft(head.embed(block_ids)[:, None], prefix, torch.tensor([[prefix.shape[1]]]))
        want = draft.propose(hidden[:, 0, 1:], torch.tensor([anchor]), head)[0][0]
        assert tokens == want.tolist()


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_decoding_layout_keeps_values_and_greedy_output(architecture):
    """use_decoding_layout gives every fp32 linear product (the target's and the draft's layers, the
    target's LM head, the TargetHead's) a transposed copy of its weight, nothing else: same values
    and state dict, tied weights still one tensor, idempotent; a product over one row and over
    several is the float64 one within fp32 rounding; greedy speculative decoding on the re-laid
    models is still the (original) target's own greedy decoding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash2.target.layout import DecodingLinear
    from dflash2.target.state import use_decoding_layout

    target = build_target(seed=2)
    tied = Qwen3ForCausalLM(Qwen3Config(**{**target.config.to_dict(), "tie_word_embeddings": True})).eval()
    head, draft = TargetHead.from_target(target), build_random_draft(architecture)
    before = {name: t.clone() for m in (target, draft, head) for name, t in m.state_dict().items()}
    with torch.no_grad():
        logits = target(torch.tensor([PROMPT])).logits
    reference = plain_greedy(target, PROMPT, 40)
    up_proj_weight = target.model.layers[0].mlp.up_proj.weight  # of an nn.Linear
    for _ in range(2):
        use_decoding_layout(target, draft, head, tied)
    after = {name: t for m in (target, draft, head) for name, t in m.state_dict().items()}
    assert after.keys() == before.keys() and all(torch.equal(before[name], after[name]) for name in before)
    linears = [
        m for m in (*target.modules(), *draft.modules()) if isinstance(m, (torch.nn.Linear, DecodingLinear))
    ]
    assert linears and all(type(m) is DecodingLinear for m in linears)
    assert target.model.layers[0].mlp.up_proj.weight is up_proj_weight
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    products = [(m.weight, m.weight_t) for m in linears] + [(head.lm_head_weight, head.lm_head_weight_t)]
    assert all(w.is_contiguous() and wt.is_contiguous() and torch.equal(wt, w.t()) for w, wt in products)
    up_proj = target.model.layers[0].mlp.up_proj  # a DecodingLinear
    for product, weight in (
        (target.lm_head, target.lm_head.weight),
        (up_proj, up_proj.weight),
        (head.logits, head.lm_head_weight),
    ):
        hidden = torch.randn(1, 4, weight.shape[1])
        want = hidden.double() @ weight.double().t()
        with torch.no_grad():
            for rows in (slice(0, 1), slice(0, 4)):  # one row (a decoding step) and a block
                torch.testing.assert_close(
                    product(hidden[:, rows]).double(), want[:, rows], rtol=1e-5, atol=1e-5
                )
    with torch.no_grad():
        torch.testing.assert_close(target(torch.tensor([PROMPT])).logits, logits, rtol=1e-5, atol=1e-5)
    result = decode.speculative_generate(draft, target, head, PROMPT, max_new_tokens=40)
    assert result.output_ids == reference == decode.target_generate(target, PROMPT, max_new_tokens=40)
    bf16 = build_target(seed=2).to(torch.bfloat16)
    use_decoding_layout(bf16)  # bf16 weights stay as loaded
    assert type(bf16.lm_head) is torch.nn.Linear and type(bf16.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_decoding_layout_follows_weight_changes_and_trains_like_linear():
    """A re-laid linear or TargetHead whose weight changes in place (an optimizer step,
    load_state_dict) computes with the new weight at one row and at several, never with a stale
    transposed copy; with gradients enabled a DecodingLinear gives nn.Linear's own gradients."""
    from dflash2.target.state import use_decoding_layout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5, bias=False))
    reference = copy.deepcopy(model)
    head = TargetHead(torch.randn(7, 5), torch.randn(7, 5))
    use_decoding_layout(model, head)
    x = torch.randn(4, 8)
    for rows in (x, x[:1]):  # the products over several rows, then over one row
        loss, want = model(rows).square().sum(), reference(rows).square().sum()
        loss.backward(), want.backward()
        for got, ref in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-6)
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    head.lm_head_weight.mul_(-2.0)  # in place, as load_state_dict does
    with torch.no_grad():
        for rows in (x[:1], x):
            torch.testing.assert_close(model(rows), reference(rows), rtol=1e-5, atol=1e-6)
            hidden = torch.randn(len(rows), 5)
            want = F.linear(hidden, head.lm_head_weight)
            torch.testing.assert_close(head.logits(hidden), want, rtol=1e-5, atol=1e-6)
        reference[0].weight.add_(1.0)
        model.load_state_dict(reference.state_dict())
        torch.testing.assert_close(model(x[:1]), reference(x[:1]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ sampling is lossless

SMALL_VOCAB, TEMPERATURE, NUM_RUNS = 6, 1.0, 1000


def exact_marginals(target, prompt: list[int]) -> torch.Tensor:
    """Exact marginals [3, V] of the first three tokens the target itself would sample."""
    vocab = SMALL_VOCAB
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / TEMPERATURE, -1)  # [V]
        seqs1 = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = torch.softmax(target(seqs1).logits[:, -1].double() / TEMPERATURE, -1)  # [V, V]
        seqs2 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(target(seqs2).logits[:, -1].double() / TEMPERATURE, -1).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    return torch.stack([p1, joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))])


def null_tv_bound(marginal: torch.Tensor, num_runs: int, seed: int = 0) -> float:
    """The largest total variation that 400 exact samplers of `num_runs` draws show (~ its 99.75%
    quantile): the noise a correct implementation is allowed."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(marginal.float(), num_runs * 400, replacement=True, generator=gen).view(400, -1)
    freq = torch.nn.functional.one_hot(draws, marginal.numel()).double().mean(1)
    return float(0.5 * (freq - marginal).abs().sum(-1).max())


@pytest.mark.parametrize(
    "kind, target_seed, draft_seed",
    [("dense", 5, 8), pytest.param("hybrid", 6, 9, marks=pytest.mark.slow)],  # hybrid: ~13 s alone
)
def test_sampling_is_lossless(kind, target_seed, draft_seed):
    """Sampling at T > 0 with a random DFlash 2 draft (q != p): over NUM_RUNS seeded runs the 2nd and
    3rd tokens (drawn by accept / reject-and-resample / bonus, never by the prefill) follow the
    target's own distribution. The allowed total variation is the largest one 400 simulated exact
    samplers show (about 0.05 here); a verifier that resamples from p instead of max(p - q, 0), or
    that accepts every proposal, lands at 0.1 to 0.3. On the hybrid target, a 3rd token drawn after
    a rejection at the first slot comes from the state rolled back to the 2nd token."""
    if kind == "dense":
        target = build_target(vocab_size=SMALL_VOCAB, seed=target_seed, num_layers=2)
    else:
        target = build_hybrid_target(vocab_size=SMALL_VOCAB, seed=target_seed)
    head = TargetHead.from_target(target)
    draft = build_random_draft(
        "DFlash2DraftModel",
        vocab_size=SMALL_VOCAB,
        seed=draft_seed,
        top_k=4,
        target_layer_ids=(0, 1),
        num_layers=1,
    )
    prompt = [1, 4, 3, 0, 2]
    exact = exact_marginals(target, prompt)
    counts = torch.zeros(2, SMALL_VOCAB, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    num_accepted = num_rollbacks = 0
    for _ in range(NUM_RUNS):
        result = decode.speculative_generate(
            draft, target, head, prompt, max_new_tokens=3, temperature=TEMPERATURE, generator=generator
        )
        counts[0, result.output_ids[1]] += 1
        counts[1, result.output_ids[2]] += 1
        num_accepted += result.acceptance_lengths[0] > 1
        num_rollbacks += result.num_rollback_forwards > 0
    for position in (0, 1):
        tv = float(0.5 * (counts[position] / NUM_RUNS - exact[position + 1]).abs().sum())
        bound = null_tv_bound(exact[position + 1], NUM_RUNS, seed=position)
        assert tv < bound, f"token {position + 2}: total variation {tv:.4f} >= {bound:.4f}"
    # Both branches ran: some first proposals were accepted, some rejected.
    assert 0.1 * NUM_RUNS < num_accepted < 0.9 * NUM_RUNS, num_accepted
    # Only the hybrid rolls back, whenever the first block was partly rejected.
    assert (num_rollbacks > 0.1 * NUM_RUNS) if kind == "hybrid" else num_rollbacks == 0, num_rollbacks


def test_verify_sampling_matches_target_distribution():
    """The accept / reject rule alone, for a full-vocabulary q (DFlash v1) and a q that is zero
    outside a few candidates (DFlash 2): the first committed token is distributed as p[0]."""
    gen = torch.Generator().manual_seed(0)
    vocab, num_trials = 10, 5000
    target_logits = torch.randn(3, vocab, generator=gen) * 2
    p = torch.softmax(target_logits, -1)
    q_full = torch.softmax(torch.randn(2, vocab, generator=gen) * 2, -1)
    q_sparse = torch.zeros(2, vocab)
    q_sparse[:, :4] = torch.softmax(torch.randn(2, 4, generator=gen), -1)
    for q in (q_full, q_sparse):
        counts = torch.zeros(vocab)
        for _ in range(num_trials):
            proposals = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            n, token = decode.verify_sampling(proposals, q, target_logits, 1.0, gen)
            counts[proposals[0] if n > 0 else token] += 1
        tv = float(0.5 * (counts / num_trials - p[0]).abs().sum())
        bound = null_tv_bound(p[0].double(), num_trials)
        assert tv < bound, (tv, bound)


def test_a_rejection_where_p_and_q_agree_to_rounding_draws_from_p(monkeypatch):
    """u within an ulp of 1 rejects a proposal whose p / q rounds to just below 1: max(p - q, 0) then
    has no mass (it crashed on an assert), and the token comes from p."""
    p = torch.softmax(torch.tensor([[2.0, 1.0, 0.5], [0.0, 0.0, 0.0]]), -1)
    q = p[:1].clone()
    q[0, 0] = torch.nextafter(p[0, 0], torch.tensor(2.0))  # q(x) one ulp above p(x): ratio below 1
    monkeypatch.setattr(decode.torch, "rand", lambda *a, **k: torch.tensor(1.0 - 2**-24))
    n, token = decode.verify_sampling([0], q, torch.log(p), 1.0, torch.Generator().manual_seed(0))
    assert n == 0 and 0 <= token < 3


def test_at_a_temperature_the_target_alone_samples_too(target, head):
    """The speed reference at T > 0 is the target's own sampling (its outputs and lengths are those
    speculative sampling draws from), seeded like the drafts; no greedy-only figure is reported."""
    generator = torch.Generator().manual_seed(3)
    sampled = [
        decode.target_generate(target, PROMPT, max_new_tokens=12, temperature=1.0, generator=generator)
        for _ in range(4)
    ]
    assert len({tuple(s) for s in sampled}) > 1  # sampled, not the greedy output four times
    draft = build_random_draft("DFlashDraftModel")
    summary, _ = ev.evaluate_prompts(draft, target, head, [PROMPT], max_new_tokens=12, temperature=1.0)
    again, _ = ev.evaluate_prompts(draft, target, head, [PROMPT], max_new_tokens=12, temperature=1.0)
    assert summary["target_generated_tokens"] == again["target_generated_tokens"]  # seeded
    assert "outputs_equal_target" not in summary and "prompt_lookup_tau" not in summary
    greedy, _ = ev.evaluate_prompts(draft, target, head, [PROMPT], max_new_tokens=12)
    assert greedy["outputs_equal_target"] == 1 and "prompt_lookup_tau" in greedy


# ------------------------------------------------------------------ speedup over the target alone

TARGET_FORWARD_S, DRAFT_STEP_S = 1.0, 0.25


class FakeClock:
    """Time that passes only when the target runs a forward (1 s) or the draft a block (0.25 s)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def timed_models(target, monkeypatch, draft_block):
    clock = FakeClock()
    handle = target.register_forward_pre_hook(lambda *_: clock.advance(TARGET_FORWARD_S))

    def block(*args, **kwargs):
        clock.advance(DRAFT_STEP_S)
        return draft_block(*args, **kwargs)

    monkeypatch.setattr(decode, "draft_block", block)
    return clock, handle


def oracle_draft_block(reference: list[int]):
    """Proposes the target's own greedy continuation of PROMPT (every block accepted)."""

    def block(draft, head, context, anchor, temperature=0.0, generator=None):
        start = context.length + 1 - len(PROMPT)
        padded = reference[start : start + draft.block_size - 1] + [0] * draft.block_size
        return torch.tensor(padded[: draft.block_size - 1]), None, torch.ones(draft.block_size - 1, 300) / 300

    return block


@pytest.mark.parametrize("draft_kind", ["oracle", "random"])
def test_speedup_is_the_ratio_of_the_measured_times(target, head, monkeypatch, draft_kind):
    """On a fake clock where a target forward takes 1 s and a draft block 0.25 s, the target alone
    spends one forward per token and speculative decoding one forward (+ one block) per verify
    step: the summary's speeds and speedup are exactly those times' ratios, and the table says
    when speculative decoding is slower."""
    draft = build_random_draft("DFlash2DraftModel", block_size=4)
    reference = plain_greedy(target, PROMPT, 40)
    block = oracle_draft_block(reference) if draft_kind == "oracle" else decode.draft_block
    clock, handle = timed_models(target, monkeypatch, block)
    prompts = [PROMPT, PROMPT]
    try:
        summary, results = ev.evaluate_prompts(draft, target, head, prompts, max_new_tokens=40, clock=clock)
    finally:
        handle.remove()
    tokens = sum(len(r.output_ids) for r in results)
    steps = sum(len(r.acceptance_lengths) for r in results)
    spec_s = (len(prompts) + steps) * TARGET_FORWARD_S + steps * DRAFT_STEP_S
    target_s = tokens * TARGET_FORWARD_S  # prefill + one forward per further token: one per token
    assert summary["target_wall_s"] == target_s and summary["wall_s"] == spec_s
    assert summary["target_tokens_per_s"] == tokens / target_s
    assert summary["spec_tokens_per_s"] == summary["tokens_per_s"] == tokens / spec_s
    assert summary["speedup"] == pytest.approx(target_s / spec_s)
    assert summary["outputs_equal_target"] == 2 and tokens == 80
    table = ev.format_table(summary)
    if draft_kind == "oracle":  # 1 + 9 x 4 + 3 tokens: 11 forwards + 10 blocks for 40 tokens
        assert summary["speedup"] == pytest.approx(80 / (2 * 11 + 2 * 10 * DRAFT_STEP_S))
        assert "faster than the target alone" in table
    else:  # tau ~ 1: every token costs a forward and a block
        assert summary["speedup"] < 1
        assert f"{summary['speedup']:.2f}x: speculative decoding is slower than the target alone" in table


def test_a_one_time_cost_of_the_first_forward_falls_on_no_timed_decode(target, head, monkeypatch):
    # a GPU's first forward loads kernels and library handles: on a fake clock where the process's
    # first target forward costs 100 s more, the speedup is what the steady forwards give
    draft = build_random_draft("DFlashDraftModel", block_size=4)
    clock, handle = timed_models(target, monkeypatch, decode.draft_block)
    first = target.register_forward_pre_hook(lambda *_: first.remove() or clock.advance(100.0))
    try:
        summary, results = ev.evaluate_prompts(
            draft, target, head, [PROMPT, PROMPT], max_new_tokens=20, clock=clock
        )
    finally:
        handle.remove()
    tokens = sum(len(r.output_ids) for r in results)
    steps = sum(len(r.acceptance_lengths) for r in results)
    assert summary["target_wall_s"] == tokens * TARGET_FORWARD_S
    assert summary["wall_s"] == (2 + steps) * TARGET_FORWARD_S + steps * DRAFT_STEP_S


def test_the_two_decodes_take_turns_prompt_by_prompt(target, head, monkeypatch):
    order = []
    spec, plain = ev.speculative_generate, ev.timed_target_generate
    monkeypatch.setattr(ev, "speculative_generate", lambda *a, **k: order.append("spec") or spec(*a, **k))
    monkeypatch.setattr(ev, "timed_target_generate", lambda *a, **k: order.append("target") or plain(*a, **k))
    draft = build_random_draft("DFlashDraftModel")
    summary, _ = ev.evaluate_prompts(draft, target, head, [PROMPT, PROMPT[:4], PROMPT[:6]], max_new_tokens=5)
    # the untimed warm-up decode first (its target decode is untimed too: not spied here)
    assert order == ["spec", "target", "spec", "spec", "target", "target", "spec"]
    assert summary["outputs_equal_target"] == 3
    order.clear()
    summary, _ = ev.evaluate_prompts(draft, target, head, [PROMPT], max_new_tokens=5, compare_target=False)
    assert order == ["spec", "spec"] and "speedup" not in summary


def test_several_drafts_take_turns_with_one_target_decode_and_each_gets_its_own_result(
    target, head, monkeypatch
):
    """compare_drafts: each prompt decoded once by the target alone and once by every draft, the
    decodes of prompt i starting from the (i mod 3)-th; every draft's summary and outputs are those
    of evaluating it alone (at temperature 1 too: each draft samples from its own generator), and
    every draft's speedup is over the same target decodes."""
    drafts = [build_random_draft("DFlashDraftModel"), build_random_draft("DFlash2DraftModel", seed=3)]
    prompts = [PROMPT, PROMPT[:4], PROMPT[:6], PROMPT[:5]]
    order = []
    spec, plain = ev.speculative_generate, ev.timed_target_generate

    def spied_spec(draft, *args, **kwargs):
        order.append(f"draft {drafts.index(draft)}")
        return spec(draft, *args, **kwargs)

    monkeypatch.setattr(ev, "speculative_generate", spied_spec)
    monkeypatch.setattr(ev, "timed_target_generate", lambda *a, **k: order.append("target") or plain(*a, **k))
    for temperature in (0.0, 1.0):
        order.clear()
        together = ev.compare_drafts(
            drafts, target, head, prompts, max_new_tokens=9, temperature=temperature, seed=7
        )
        turns = ["target", "draft 0", "draft 1"]
        warm_up = ["draft 0", "draft 1"]  # untimed, their own generator: the results below are unchanged
        assert order == warm_up + [turns[(i + j) % 3] for i in range(4) for j in range(3)]
        for draft, (summary, results) in zip(drafts, together):
            # the reference: the decoding loop itself, prompt by prompt, one generator seeded as the draft's
            generator = torch.Generator().manual_seed(7)
            alone = [
                spec(draft, target, head, ids, max_new_tokens=9, temperature=temperature, generator=generator)
                for ids in prompts
            ]
            assert [r.output_ids for r in results] == [r.output_ids for r in alone]
            assert [r.acceptance_lengths for r in results] == [r.acceptance_lengths for r in alone]
            taus = [t for r in alone for t in r.acceptance_lengths]
            assert summary["mean_acceptance_length"] == sum(taus) / len(taus)
            assert summary["generated_tokens"] == sum(len(r.output_ids) for r in alone)
        target_s = [s["target_wall_s"] for s, _ in together]
        assert target_s[0] == target_s[1] > 0  # one set of target decodes for both
        for summary, _ in together:
            assert summary["speedup"] == pytest.approx(
                summary["spec_tokens_per_s"] / summary["target_tokens_per_s"]
            )


# ------------------------------------------------------------------ CLI on the tiny default


def test_cli_writes_json_tensorboard_and_plot(tiny_default, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dflash2.export import export_draft
    from tests.conftest import REPO_ROOT

    torch.manual_seed(0)
    draft = build_draft(REPO_ROOT / "configs" / "draft" / "tiny-dflash2.json")
    export = export_draft(draft, tmp_path / "export", dtype=torch.float32)
    out, tb, png = tmp_path / "eval.json", tmp_path / "tb", tmp_path / "tau.png"
    args = [
        "--draft",
        str(export),
        "--target",
        str(tiny_default.target_dir),
        "--data",
        str(tiny_default.heldout_jsonl),
    ]
    args += [
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        "--tb-dir",
        str(tb),
        "--plot",
        str(png),
    ]
    ev.main(args)
    printed = capsys.readouterr().out
    assert "mean acceptance length" in printed and "target alone tokens/s" in printed
    summary = json.loads(out.read_text())
    histogram = summary["acceptance_histogram"]
    assert list(histogram) == [str(k) for k in range(1, 9)]
    assert sum(histogram.values()) == summary["num_verify_steps"]
    taus = [int(k) for k, count in histogram.items() for _ in range(count)]
    assert summary["mean_acceptance_length"] == pytest.approx(sum(taus) / len(taus))
    # Two prompts of at most 12 tokens: each step but the prefill one commits tokens.
    assert summary["generated_tokens"] == sum(taus) + 2 <= 24
    forwards = summary["num_verify_steps"] + 2
    assert summary["target_forwards_per_token"] == pytest.approx(forwards / summary["generated_tokens"])
    events = EventAccumulator(str(tb))
    events.Reload()
    logged = events.Scalars("eval/mean_acceptance_length")
    assert logged[0].value == pytest.approx(summary["mean_acceptance_length"])
    # an export without a record of its training run: step 0, and both gaps are said
    assert logged[0].step == 0 and summary["chat_template_kwargs"] is None
    assert [note.split(":")[0] for note in summary["notes"]] == [
        f"{export} has no training_run.json step",
        f"{export} records no chat_template_kwargs of its training run",
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the target alone decoded the same prompts: both speeds and their ratio, in every output
    assert summary["spec_tokens_per_s"] == summary["tokens_per_s"] > 0
    assert summary["speedup"] == pytest.approx(summary["spec_tokens_per_s"] / summary["target_tokens_per_s"])
    assert summary["target_generated_tokens"] == summary["generated_tokens"]
    assert summary["outputs_equal_target"] == 2
    for key in ("spec_tokens_per_s", "target_tokens_per_s", "speedup", "prompt_lookup_tau"):
        assert events.Scalars(f"eval/{key}")[0].value == pytest.approx(summary[key])
    # and the draft-free reference on the same outputs: at least one token a step, at most B
    assert 1 <= summary["prompt_lookup_tau"] <= 8
    (row,) = [line for line in printed.splitlines() if line.startswith("prompt lookup tau (no draft)")]
    assert f" {summary['prompt_lookup_tau']:.3f}: 1-4-gram copying" in row


def test_cli_compares_several_drafts_against_one_target_decode(tiny_default, tmp_path, monkeypatch, capsys):
    """--draft A B: one report per draft, each equal to evaluating that draft alone (speed aside), the
    target alone decoding each prompt once; one path per draft for --out and --tb-dir, and drafts whose
    training runs rendered prompts differently are refused with the fix, as is a count of --out paths
    that is not the drafts'."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dflash2.export import export_draft
    from tests.conftest import REPO_ROOT

    exports = []
    for seed, kwargs in ((0, {}), (1, {}), (2, {"enable_thinking": False})):
        torch.manual_seed(seed)
        draft = build_draft(REPO_ROOT / "configs" / "draft" / "tiny-dflash2.json")
        run = {"step": 10 + seed, "chat_template_kwargs": kwargs}
        exports.append(export_draft(draft, tmp_path / f"export{seed}", dtype=torch.float32, training_run=run))
    common = ["--target", str(tiny_default.target_dir), "--data", str(tiny_default.heldout_jsonl)]
    common += ["--num-prompts", "3", "--max-new-tokens", "12"]
    target_decodes = []
    plain = ev.timed_target_generate
    monkeypatch.setattr(
        ev, "timed_target_generate", lambda *a, **k: target_decodes.append(1) or plain(*a, **k)
    )
    outs = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    tbs = [str(tmp_path / "tb_a"), str(tmp_path / "tb_b")]
    together = ev.main(
        ["--draft", str(exports[0]), str(exports[1]), *common, "--out", *outs, "--tb-dir", *tbs]
    )
    assert len(target_decodes) == 3
    assert [json.loads(open(o).read()) for o in outs] == together
    for tb, summary in zip(tbs, together):  # each draft's scalars in its own directory, at its own step
        events = EventAccumulator(tb)
        events.Reload()
        (logged,) = events.Scalars("eval/mean_acceptance_length")
        assert logged.step == summary["step"] and logged.value == pytest.approx(
            summary["mean_acceptance_length"]
        )
    assert [s["draft"] for s in together] == [str(exports[0]), str(exports[1])]
    assert [s["step"] for s in together] == [10, 11]
    printed = capsys.readouterr().out
    assert printed.count("mean acceptance length (tau)") == 2 and str(exports[1]) in printed
    for export, summary in zip(exports, together):
        if export == exports[0]:  # from Python, the CLI's defaults for what is not given
            alone = ev.evaluate(
                export, tiny_default.target_dir, tiny_default.heldout_jsonl, num_prompts=3, max_new_tokens=12
            )
        else:
            (alone,) = ev.main(["--draft", str(export), *common])
        for key in (
            "mean_acceptance_length",
            "acceptance_histogram",
            "generated_tokens",
            "prompt_lookup_tau",
        ):
            assert summary[key] == alone[key]
    with pytest.raises(ValueError, match="different chat_template_kwargs .* evaluate them one at a time"):
        ev.main(["--draft", str(exports[0]), str(exports[2]), *common])
    # an export that records no arguments (the template's defaults) goes with one that records {}
    bare = export_draft(draft, tmp_path / "bare", dtype=torch.float32)
    mixed = ev.main(["--draft", str(bare), str(exports[0]), *common])
    assert [s["chat_template_kwargs"] for s in mixed] == [None, {}]
    assert mixed[1]["mean_acceptance_length"] == together[0]["mean_acceptance_length"]
    with pytest.raises(ValueError, match=r"--out: give one path per draft \(2\), got 1"):
        ev.main(["--draft", str(exports[0]), str(exports[1]), *common, "--out", outs[0]])


def test_evaluation_defaults_to_the_training_run_of_the_export(tmp_path):
    (tmp_path / "training_run.json").write_text(
        json.dumps({"step": 300, "chat_template_kwargs": {"enable_thinking": False}})
    )
    assert ev.run_settings(tmp_path, None) == ({"enable_thinking": False}, 300, [])
    assert ev.run_settings(tmp_path, {"enable_thinking": False}) == ({"enable_thinking": False}, 300, [])
    # an explicit choice wins, and the difference is said
    kwargs, step, notes = ev.run_settings(tmp_path, {"enable_thinking": True})
    assert kwargs == {"enable_thinking": True} and step == 300
    assert len(notes) == 1 and "differ from the training run's {'enable_thinking': False}" in notes[0]


def test_cli_evaluates_in_bf16_when_asked(tiny_default, tmp_path, monkeypatch):
    """--precision bf16 loads the target, the draft and the head in bf16 (fp32 by default)."""
    from dflash2.export import export_draft
    from tests.conftest import REPO_ROOT

    torch.manual_seed(0)
    draft = build_draft(REPO_ROOT / "configs" / "draft" / "tiny-dflash2.json")
    export = export_draft(draft, tmp_path / "export", dtype=torch.float32)
    loaded = []
    load_target, load_draft_for = ev.load_target, ev.load_draft_for

    def spy_target(*args):
        target, head, tokenizer = load_target(*args)
        loaded.append({next(target.parameters()).dtype, head.lm_head_weight.dtype})
        return target, head, tokenizer

    def spy_draft(*args):
        draft = load_draft_for(*args)
        loaded[-1].add(next(draft.parameters()).dtype)
        return draft

    monkeypatch.setattr(ev, "load_target", spy_target)
    monkeypatch.setattr(ev, "load_draft_for", spy_draft)
    common = ["--draft", str(export), "--target", str(tiny_default.target_dir)]
    common += ["--data", str(tiny_default.heldout_jsonl), "--num-prompts", "1", "--max-new-tokens", "8"]
    summaries = [*ev.main(common), *ev.main([*common, "--precision", "bf16"])]
    assert loaded == [{torch.float32}, {torch.bfloat16}]
    assert [s["precision"] for s in summaries] == ["fp32", "bf16"]
    assert all(1 <= s["generated_tokens"] <= 8 for s in summaries)


def test_decode_benchmark_breaks_a_verify_step_down(tiny_default, tmp_path):
    """benchmarks/eval_decode.py: both decodes of every prompt, a verify step split into regions
    whose self times and `other` add up to the step, and the same greedy output from both."""
    import importlib.util

    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("eval_decode", REPO_ROOT / "benchmarks" / "eval_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--target", str(tiny_default.target_dir), "--data", str(tiny_default.heldout_jsonl)]
    args += ["--max-new-tokens", "12", "--num-prompts", "2", "--draft-layers", "1", "--block-size", "4"]
    report = bench.main([*args, "--window-steps", "4", "--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["generated_tokens"] == 24 and report["outputs_equal_target"] == 2
    step = report["verify_step"]
    regions = {"draft_block/forward", "draft_block/propose/head", "draft_block/propose/selector", "verify"}
    assert regions | {"rollback", "draft_context", "accept"} <= set(step)
    parts = sum(t["wall_ms"] for name, t in step.items() if name != "step")
    assert parts == pytest.approx(step["step"]["wall_ms"], rel=1e-6)  # every step timed whole
    assert report["speedup"] == pytest.approx(report["spec_tokens_per_s"] / report["target_tokens_per_s"])
    ratio = step["step"]["wall_ms"] / report["plain_step_ms"]
    assert report["verify_step_in_plain_steps"] == pytest.approx(ratio)
    assert report["dtypes"] == {"target": "torch.float32", "draft": "torch.float32"}
    bf16 = bench.main([*args, "--window-steps", "4", "--precision", "bf16"])
    assert bf16["dtypes"] == {"target": "torch.bfloat16", "draft": "torch.bfloat16"}
    assert bf16["generated_tokens"] == 24
    with pytest.raises(ValueError, match="--max-new-tokens=1: must be >= 2"):
        bench.parse_args([*args[:4], "--max-new-tokens", "1"])


def test_decode_benchmark_renders_prompts_and_warms_up_as_evaluate_does(tiny_default, tmp_path, monkeypatch):
    import importlib.util

    from dflash2.export import export_draft
    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("eval_decode", REPO_ROOT / "benchmarks" / "eval_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    draft = build_draft(REPO_ROOT / "configs" / "draft" / "tiny-dflash2.json")
    kwargs = {"enable_thinking": False}
    training_run = {"step": 3, "chat_template_kwargs": kwargs}
    export = export_draft(draft, tmp_path / "export", dtype=torch.float32, training_run=training_run)
    rendered, calls = [], []
    encode = bench.encode_prompt
    monkeypatch.setattr(
        bench, "encode_prompt", lambda m, tok, kw=None: rendered.append(kw) or encode(m, tok, kw)
    )
    monkeypatch.setattr(bench, "warm_up", lambda *a: calls.append(("warm_up", a[5])))
    generate = bench.decode.timed_target_generate
    monkeypatch.setattr(
        bench.decode, "timed_target_generate", lambda *a, **k: calls.append("timed") or generate(*a, **k)
    )
    args = [
        "--target",
        str(tiny_default.target_dir),
        "--data",
        str(tiny_default.heldout_jsonl),
        "--draft",
        str(export),
    ]
    bench.main([*args, "--max-new-tokens", "8", "--num-prompts", "2", "--window-steps", "2"])
    assert rendered == [kwargs, kwargs]  # the export's training run's template arguments
    assert calls == [("warm_up", 8), "timed", "timed"]  # the warm-up before any timed decode


def test_the_demos_evaluate_each_draft_in_the_precision_asked_and_count_equal_outputs(tiny_default, tmp_path):
    """launch/demo.py's evaluate_drafts (make demo, make demo-real): every draft's report in the
    precision asked, and the count of greedy outputs equal to the target's own (all of them in fp32,
    where speculative decoding is exact) next to its tau."""
    from tests.run_helpers import load_script

    demo = load_script("launch/demo.py")
    draft = demo.export_untrained(tmp_path / "untrained" / "export")
    for precision in ("fp32", "bf16"):
        results = demo.evaluate_drafts(
            tiny_default, [("tau_untrained", draft)], 3, 8, f"eval_{precision}", precision
        )
        report = json.loads((tmp_path / "untrained" / f"eval_{precision}.json").read_text())
        assert report["precision"] == precision and report["num_prompts"] == 3
        assert results["tau_untrained"] == report["mean_acceptance_length"]
        assert results["outputs_equal_untrained"] == report["outputs_equal_target"]
    fp32 = json.loads((tmp_path / "untrained" / "eval_fp32.json").read_text())
    assert fp32["outputs_equal_target"] == 3
    # as the demos call it: the untrained export (no record of a training run) beside trained ones
    from dflash2.export import export_draft
    from dflash2.models import load_draft

    run = {"step": 5, "chat_template_kwargs": {}}
    trained = export_draft(load_draft(draft), tmp_path / "dflash2" / "export", training_run=run)
    results = demo.evaluate_drafts(tiny_default, [("tau_untrained", draft), ("tau_dflash2", trained)], 3, 8)
    assert results["tau_untrained"] == fp32["mean_acceptance_length"]
    assert results["tau_dflash2"] == results["tau_untrained"] and results["speedup_dflash2"] > 0
    assert json.loads((tmp_path / "dflash2" / "eval.json").read_text())["step"] == 5


def test_a_demo_rerun_resumes_replies_only_of_the_same_settings(tmp_path, capsys):
    """launch/demo.py: replies regenerated under other settings (a precision, a length limit, other
    prompts) are moved aside, not trained on beside the new ones; the same settings resume them."""
    from tests.run_helpers import load_script

    demo = load_script("launch/demo.py")
    regen = tmp_path / "data" / "train.regenerated.jsonl"
    regen.parent.mkdir()
    settings = {"target": "t", "prompts": "p", "max_new_tokens": 128, "dtype": "bfloat16", "capture": []}
    regen.write_text('{"id": "a"}\n')
    demo.keep_only_if_same(regen, settings)  # no settings on record (an earlier version): moved aside
    (aside,) = tmp_path.glob("data/train.regenerated.other-settings-*.jsonl")
    assert not regen.exists() and aside.read_text() == '{"id": "a"}\n'
    assert "holds replies of other settings" in capsys.readouterr().out
    regen.write_text('{"id": "b"}\n')  # a crash part-way: the same settings resume it
    demo.keep_only_if_same(regen, settings)
    assert regen.read_text() == '{"id": "b"}\n'
    aside.unlink()
    demo.keep_only_if_same(regen, {**settings, "dtype": "float32"})  # another precision: set aside
    assert not regen.exists() and len(list(tmp_path.glob("data/*.other-settings-*.jsonl"))) == 1


def test_a_draft_config_that_cannot_serve_the_target_is_refused_before_the_target_loads(
    tiny_default, tmp_path, monkeypatch
):
    """Its config.json against the target's, before a weight loads (a large target takes minutes to
    load, after which the draft was refused); the fix names the command that makes a fitting config,
    and a training run's directory given as the draft names its export."""

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(ev, "load_full_target", no_target)
    cfg = json.loads((REPO / "configs" / "draft" / "tiny-dflash2.json").read_text())
    cfg["num_target_layers"] = cfg["dflash_config"]["num_target_layers"] = 40
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    heldout = tiny_default.heldout_jsonl
    with pytest.raises(ValueError, match="does not fit the target: num_target_layers=40 but") as refused:
        ev.evaluate(tmp_path / "other", tiny_default.target_dir, heldout)
    fix = f"python -m dflash2.draft_config --target {tiny_default.target_dir} --arch DFlash2DraftModel --out"
    assert fix in str(refused.value)
    (tmp_path / "run" / "export").mkdir(parents=True)
    (tmp_path / "run" / "export" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=f"this looks like a training run: its export is {tmp_path / 'run' / 'export'}"
    ):
        ev.evaluate(tmp_path / "run", tiny_default.target_dir, heldout)
