"""The tokenizer every fixture shares (a byte-level BPE trained on a paragraph of text) and each family's
tokenizer.json and tokenizer_config.json around it (BOS or not, chat template, special tokens)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .chat_templates import MIXTRAL_CHAT_TEMPLATE, OLMOE_CHAT_TEMPLATE, QWEN2_MOE_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from .files import write_json

VOCAB_SIZE = 512  # model vocab (embedding rows); the tokenizer uses BPE_VOCAB_SIZE + 7 of them
BPE_VOCAB_SIZE = 500  # 256 byte symbols + learned merges
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
PLAIN_ADDED_TOKENS = ["<think>", "</think>"]  # added but not "special", as in Qwen3's tokenizer

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a language
if it sees enough text, and a tokenizer only needs a little text to learn which pairs of letters
belong together. This paragraph is the whole of its education.

Once upon a time there was a quiet village by the sea. Every morning the fishermen went out in
their boats, and every evening they came back with the day's catch. The children ran along the
shore and counted the boats as they returned: one, two, three, four, five. When the weather was
bad, the boats stayed in the harbour and the village waited for the wind to change.

Computers read numbers, not words. Before a language model can read a sentence, the sentence is
split into pieces called tokens, and each token is given a number. The model then predicts the
next token, one step at a time. Greedy decoding always picks the token with the highest score.
Sampling picks a token at random, with more likely tokens chosen more often.

A mixture of experts replaces one large feed-forward layer with many small ones. A router looks at
each token and chooses which experts should process it. Only the chosen experts run, so the model
can hold many parameters while spending little compute on each token. The router's choice depends
on the hidden state, and the outputs of the chosen experts are added together with weights.

Hello there! How are you today? I am fine, thank you. What would you like to talk about? We could
talk about the weather, about books, about music, or about the history of mathematics. Questions
and answers, requests and replies: that is what a conversation is made of.

In the spring the gardens were full of flowers: red roses, yellow tulips, white lilies and blue
irises. The bees moved from one flower to the next, and the birds sang in the trees. In the summer
the days were long and warm; in the autumn the leaves turned gold and fell; in the winter the snow
covered the hills and the rivers froze.

The numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 and 42 appear in many texts, as do
symbols such as + - * / = < > ( ) [ ] { } # @ & % $ and the quotation marks ' and ".
"""


@dataclass
class TokenizerStyle:
    """How a family's tokenizer files look."""

    chat_template: str
    eos_token: str
    bos_token: str | None
    add_bos_token: bool
    pad_token: str | None
    extra_special_tokens: list[str] = field(default_factory=list)
    generation_eos: list[str] = field(default_factory=list)  # generation_config eos ids (first = config eos)
    generation_extra: dict = field(default_factory=dict)


QWEN_TOKENIZER = TokenizerStyle(
    chat_template=QWEN3_CHAT_TEMPLATE,
    eos_token="<|im_end|>",
    bos_token=None,
    add_bos_token=False,
    pad_token="<|endoftext|>",
    extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    generation_eos=["<|im_end|>", "<|endoftext|>"],
    generation_extra={"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
)
QWEN2_MOE_TOKENIZER = copy.deepcopy(QWEN_TOKENIZER)
QWEN2_MOE_TOKENIZER.chat_template = QWEN2_MOE_CHAT_TEMPLATE
QWEN2_MOE_TOKENIZER.generation_extra = {}
MIXTRAL_TOKENIZER = TokenizerStyle(
    chat_template=MIXTRAL_CHAT_TEMPLATE,
    eos_token="</s>",
    bos_token="<s>",
    add_bos_token=True,
    pad_token=None,
    generation_eos=["</s>"],
)
OLMOE_TOKENIZER = TokenizerStyle(
    chat_template=OLMOE_CHAT_TEMPLATE,
    eos_token="<|endoftext|>",
    bos_token="<|endoftext|>",
    add_bos_token=False,
    pad_token=None,
    generation_eos=["<|endoftext|>"],
)


def train_base_tokenizer() -> Tokenizer:
    """Train the shared byte-level BPE on TRAINING_TEXT and append the added tokens.

    Learned tokens get ids 0..BPE_VOCAB_SIZE-1; the special and plain added tokens follow
    (as in Qwen's tokenizer, where they sit after the BPE vocabulary).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE vocab is {tok.get_vocab_size()}, expected {BPE_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) > VOCAB_SIZE:
        raise RuntimeError("tokenizer does not fit the model vocab")
    return tok


def family_tokenizer(base: Tokenizer, style: TokenizerStyle) -> Tokenizer:
    """Copy of the base tokenizer with the family's post-processor (BOS or not)."""
    tok = Tokenizer.from_str(base.to_str())
    if style.add_bos_token:
        bos, bos_id = style.bos_token, tok.token_to_id(style.bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(tok: Tokenizer, style: TokenizerStyle) -> dict:
    """tokenizer_config.json contents, in the hub's usual key order."""
    added = {}
    for token_id, token in sorted(tok.get_added_tokens_decoder().items()):
        added[str(token_id)] = {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
    cfg = {
        "add_bos_token": style.add_bos_token,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
    }
    if style.extra_special_tokens:
        cfg["additional_special_tokens"] = style.extra_special_tokens
    cfg.update(
        {
            "bos_token": style.bos_token,
            "chat_template": style.chat_template,
            "clean_up_tokenization_spaces": False,
            "eos_token": style.eos_token,
            "model_max_length": 4096,
            "pad_token": style.pad_token,
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        }
    )
    return cfg


def write_tokenizer(out: Path, base: Tokenizer, style: TokenizerStyle) -> Tokenizer:
    tok = family_tokenizer(base, style)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, style))
    return tok

