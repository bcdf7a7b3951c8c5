"""The tiny default: a small trained Qwen3 target, its tokenizer and a chat corpus, built on CPU.

`build_tiny_default(out_dir)` writes
    <out_dir>/target/               Hugging Face Qwen3ForCausalLM + tokenizer (AutoTokenizer-loadable)
    <out_dir>/data/train.jsonl      training_jsonl conversations
    <out_dir>/data/heldout.jsonl    held-out conversations (first prompts never seen in train)
    <out_dir>/build_info.json       final training loss, a sample greedy continuation, timings
    <out_dir>/stamp.json            hash of this builder's code + parameters (written last)
and returns at once when the stamp matches. The build is seeded and takes about two minutes on two
CPU cores; a file lock beside `out_dir` keeps concurrent callers from building twice.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash2 import schedule
from dflash2.data import tiny_corpus
from dflash2.schedule import lr_factor

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, MASK]  # ids 0, 1, 2, 3 in this order
MASK_TOKEN_ID = 3
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TARGET_DIMS = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    vocab_size=1024,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class BuildParams:
    seed: int = 0
    num_train: int = 2000
    num_heldout: int = 32
    bpe_vocab_size: int = 640
    train_steps: int = 400
    batch_size: int = 16
    learning_rate: float = 4e-3
    warmup_steps: int = 30
    sample_new_tokens: int = 80  # length of the greedy sample recorded in build_info.json


@dataclass(frozen=True)
class TinyDefault:
    root: Path
    target_dir: Path
    train_jsonl: Path
    heldout_jsonl: Path
    mask_token_id: int = MASK_TOKEN_ID


def build_tiny_default(
    out_dir: str | Path = "artifacts/tiny", force: bool = False, params: BuildParams | None = None
) -> TinyDefault:
    """Build (or reuse, when the stamp matches) the tiny default under `out_dir`."""
    root = Path(out_dir).resolve()
    params = params or BuildParams()
    stamp = _stamp(params)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the with-block closes the file
        if force or _read_stamp(root) != stamp:
            _build(root, params, stamp)
    return _paths(root)


def _paths(root: Path) -> TinyDefault:
    return TinyDefault(
        root=root,
        target_dir=root / "target",
        train_jsonl=root / "data" / "train.jsonl",
        heldout_jsonl=root / "data" / "heldout.jsonl",
    )


def _stamp(params: BuildParams) -> str:
    """Hash of the builder's code and the parameters. The code enters as its syntax tree, so
    reformatting or editing comments does not force a rebuild."""
    digest = hashlib.sha256()
    for module_file in (__file__, tiny_corpus.__file__, schedule.__file__):
        digest.update(ast.dump(ast.parse(Path(module_file).read_text())).encode())
    digest.update(json.dumps(asdict(params), sort_keys=True).encode())
    return digest.hexdigest()


def _read_stamp(root: Path) -> str | None:
    stamp_file = root / "stamp.json"
    if not stamp_file.is_file():
        return None
    return json.loads(stamp_file.read_text()).get("stamp")


def _build(root: Path, params: BuildParams, stamp: str) -> None:
    """Build into a sibling temporary directory, then swap it in, so a crash never leaves a half build."""
    started = time.time()
    staging = root.with_name(root.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    paths = _paths(staging)
    paths.train_jsonl.parent.mkdir(parents=True)

    train = tiny_corpus.make_conversations(params.num_train, params.seed)
    first_prompts = {next(t["content"] for t in conv if t["role"] == "user") for conv in train}
    heldout = tiny_corpus.make_conversations(
        params.num_heldout, params.seed + 1, exclude_prompts=first_prompts
    )
    _write_jsonl(paths.train_jsonl, "train", train)
    _write_jsonl(paths.heldout_jsonl, "heldout", heldout)

    tokenizer = build_tokenizer(train, params.bpe_vocab_size)
    model, final_loss = train_target(tokenizer, train, params)
    model.save_pretrained(paths.target_dir)
    tokenizer.save_pretrained(paths.target_dir)
    _add_legacy_dtype_key(paths.target_dir / "config.json")

    prompt = tokenizer.apply_chat_template(heldout[0][:-1], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    info = {
        "final_train_loss": final_loss,
        "real_vocab_size": len(tokenizer),
        "build_seconds": round(time.time() - started, 1),
        "sample_prompt": heldout[0][-2]["content"],
        "sample_reference": heldout[0][-1]["content"],
        "sample_greedy": _greedy_text(model, tokenizer, prompt_ids, params.sample_new_tokens),
        "params": asdict(params),
    }
    (staging / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    (staging / "stamp.json").write_text(json.dumps({"stamp": stamp}) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)


def _write_jsonl(path: Path, prefix: str, conversations: list[tiny_corpus.Conversation]) -> None:
    with open(path, "w") as f:
        for i, conv in enumerate(conversations):
            f.write(json.dumps({"id": f"{prefix}-{i:05d}", "conversations": conv}) + "\n")


def _render(conv: tiny_corpus.Conversation) -> str:
    """ChatML rendering, identical to CHAT_TEMPLATE (used before the tokenizer exists)."""
    return "".join(f"{IM_START}{t['role']}\n{t['content']}{IM_END}\n" for t in conv)


def build_tokenizer(conversations: list[tiny_corpus.Conversation], vocab_size: int):
    """Byte-level BPE trained on the rendered conversations, with fixed special-token ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((_render(conv) for conv in conversations), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    for token, token_id in zip(SPECIAL_TOKENS, range(4)):
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    return tokenizer


def target_config(tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        **TARGET_DIMS,
        hidden_act="silu",
        attention_bias=False,
        dtype="float32",
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def train_target(tokenizer, conversations: list[tiny_corpus.Conversation], params: BuildParams):
    """Next-token training on every token of the rendered conversations; returns (model, final loss).

    The final loss is the mean over the last 20 steps.
    """
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(params.seed)
    # Batches of neighbours in length order waste almost nothing on padding.
    sequences = sorted((tokenizer(_render(conv))["input_ids"] for conv in conversations), key=len)
    model = Qwen3ForCausalLM(target_config(tokenizer)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=params.learning_rate, weight_decay=0.01)
    generator = torch.Generator().manual_seed(params.seed)
    recent: list[float] = []
    for step in range(params.train_steps):
        for group in optimizer.param_groups:
            factor = lr_factor(
                step, warmup_steps=params.warmup_steps, total_steps=params.train_steps, min_lr_ratio=0.1
            )
            group["lr"] = params.learning_rate * factor
        first = int(torch.randint(len(sequences) - params.batch_size + 1, (1,), generator=generator))
        input_ids, labels = _pad_batch(sequences[first : first + params.batch_size], tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=(labels != -100).long(), labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-20:]
    return model.eval(), round(sum(recent) / len(recent), 4)


def _pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence; padded labels are -100 (ignored by the loss)."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(seq)] = torch.tensor(seq)
    return input_ids, labels


@torch.no_grad()
def _greedy_text(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> str:
    output = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=False)


def _add_legacy_dtype_key(config_path: Path) -> None:
    """transformers 5 writes `dtype`; older readers look for `torch_dtype`. Write both."""
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = config["dtype"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
