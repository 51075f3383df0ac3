"""The demo's data (`tools/train_demo.py`): its tasks, the random inputs, the one-token-per-character
tokenizer and the length-bucketed training batches of prompt ``f"{text}="`` and completion
``f"{task(text)}\\n</s>"``."""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
MAX_TEXT_CHARS = 24
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# '\n' plus printable ASCII: the demo tokenizer covers whatever a user types in the playground.
CHARACTERS = ("\n", *(chr(c) for c in range(32, 127)))

TASKS: dict[str, Callable[[str], str]] = {
    "echo": lambda t: t,
    "upper": str.upper,
    "reverse": lambda t: t[::-1],
    "rot13": lambda t: codecs.encode(t, "rot13"),
    "novowels": lambda t: "".join(c for c in t if c not in "aeiou"),
}
ADAPTERS = ("upper", "reverse", "rot13", "novowels")
# What each bundled demo model computes, by adapter name (None: the base model, which echoes).
DEMO_OUTPUTS: dict[str | None, Callable[[str], str]] = {
    None: TASKS["echo"],
    **{a: TASKS[a] for a in ADAPTERS},
}


def sample_text(rng: random.Random, alphabet: str = ALPHABET) -> str:
    """One input: 1-3 words of 1-8 uniform random letters of `alphabet`, redrawn until <= 24 characters."""
    while True:
        words = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))
        ]
        text = " ".join(words)
        if len(text) <= MAX_TEXT_CHARS:
            return text


def build_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` with one WordLevel token per character and `<s>` prepended on encode.

    ids: <pad>=0, <s>=1, </s>=2, <unk>=3, then '\\n', ' ', '!', ..., '~'. Text is split into single
    characters (any character, '\\n' included), unknown characters map to <unk>, and decoding
    concatenates the pieces (`Fuse`), so ``decode(encode(s), skip_special_tokens=True) == s`` for
    printable ASCII and newlines.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (naming the class every transformers version knows)."""
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out_dir / extra).unlink(missing_ok=True)


class ExampleStream:
    """Endless length-bucketed training batches for one task.

    Each refill draws `16 * batch_size` examples, sorts them by length and cuts them into batches (so a
    batch pads little), then shuffles the batch order. A batch is (input_ids, labels), both
    [batch, longest]: ids = encode(prompt) + completion + [</s>], right-padded with <pad>; labels are -100
    except on the completion tokens and </s>.

    Two optional shares of the inputs come from other alphabets: `mixed_case` from upper- and lowercase
    letters, `repetitive` from a random set of 2-6 lowercase letters (many repeated characters and
    substrings, which a model that finds its place by content instead of by position gets wrong).
    """

    def __init__(
        self,
        tokenizer: Any,
        task: str,
        batch_size: int,
        rng: random.Random,
        mixed_case: float = 0.0,
        repetitive: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.fn = TASKS[task]
        self.batch_size = batch_size
        self.rng = rng
        self.mixed_case = mixed_case
        self.repetitive = repetitive
        self.vocab: dict[str, int] = tokenizer.get_vocab()
        self.pending: list[list[tuple[list[int], list[int]]]] = []

    def example(self, text: str) -> tuple[list[int], list[int]]:
        """(prompt ids as the engine encodes them, completion ids ending in '\\n', </s>)."""
        prompt = list(self.tokenizer.encode(f"{text}="))
        completion = [self.vocab[c] for c in f"{self.fn(text)}\n"] + [self.tokenizer.eos_token_id]
        return prompt, completion

    def _text(self) -> str:
        u = self.rng.random()
        if u < self.mixed_case:
            return sample_text(self.rng, ALPHABET + ALPHABET.upper())
        if u < self.mixed_case + self.repetitive:
            return sample_text(self.rng, "".join(self.rng.sample(ALPHABET, self.rng.randint(2, 6))))
        return sample_text(self.rng)

    def _refill(self) -> None:
        pool = [self.example(self._text()) for _ in range(16 * self.batch_size)]
        pool.sort(key=lambda e: len(e[0]) + len(e[1]))
        self.pending = [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        self.rng.shuffle(self.pending)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.pending:
            self._refill()
        batch = self.pending.pop()
        longest = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), longest), self.tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), longest), -100, dtype=torch.long)
        for row, (prompt, completion) in enumerate(batch):
            n_p, n_c = len(prompt), len(completion)
            ids[row, : n_p + n_c] = torch.tensor(prompt + completion)
            labels[row, n_p : n_p + n_c] = torch.tensor(completion)
        return ids, labels


def eval_texts(seed: int, n: int) -> list[str]:
    """`n` held-out inputs from a stream separate from every training stream."""
    rng = random.Random(f"{seed}-eval")
    return [sample_text(rng) for _ in range(n)]
