# mypy: disable-error-code="import-not-found"
"""Make the tiny model the e2e engines serve: ``python tests/e2e/make_model.py DIR`` (engines' env).

Runs with the engines' Python (torch, transformers and tokenizers come with
vLLM); nothing is downloaded. A byte-level BPE tokenizer with 1024 tokens is
trained on a made-up corpus of syllable words, and a Llama with 2 layers,
hidden size 256 and random weights is saved beside it (about 7 MB). Both are
seeded, so every run makes the same model. The output layer is scaled up so
greedy decoding has clear winners: the P/D answer and D's own answer are then
compared token for token without ties decided by rounding.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SYLLABLES = (
    *("ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "fu"),
    *("ga", "he", "ji", "wo", "ze", "by", "cu", "vo", "xi", "qa"),
)
VOCAB = 1024
SEED = 20


def words(count: int, rng: random.Random) -> list[str]:
    """Made-up words of one to four syllables."""
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    lexicon = words(3000, rng)
    corpus = [" ".join(rng.choice(lexicon) for _ in range(24)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"make_model: the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)


def model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    llama = LlamaForCausalLM(config)
    with torch.no_grad():
        llama.lm_head.weight.mul_(20.0)
    llama.save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_model.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer(out)
    model(out)
    (out / "kvr-e2e-model.json").write_text(
        json.dumps({"seed": SEED, "vocab": VOCAB, "layers": 2, "hidden": 256})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
