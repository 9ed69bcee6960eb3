"""The built-in tiny model's tokenizer: a byte-level BPE trained on a small English corpus (nothing is downloaded),
with Qwen-style special tokens and a ChatML chat template."""
from __future__ import annotations

TOKENIZER_TARGET_SIZE = 480  # byte alphabet + merges (+3 specials -> 483)

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# Bumped whenever the on-disk result of ensure_default_tiny_model() changes.

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# GPT-4 / Qwen2 style split: contractions, letter runs (with one leading
# non-letter), single digits, punctuation runs, newlines, whitespace.
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# A few paragraphs of varied English used to train the BPE merges.
_CORPUS = [
    """The quick brown fox jumps over the lazy dog. A journey of a thousand miles
begins with a single step. Once upon a time, in a small village at the edge of a
great forest, there lived an old clockmaker who repaired watches for everyone in
town. Every morning he opened his shop at seven o'clock, swept the floor, and
wound the tall clock that stood by the door.""",
    """Large language models predict the next token given the previous tokens.
During inference, the engine keeps a key-value cache for every sequence, so that
each new token only needs one forward pass over a single position. Batching many
requests together improves throughput, while paged memory management avoids
fragmentation when sequences grow and shrink at different rates.""",
    """Hello! How are you today? I'm doing well, thank you for asking. Could you
tell me the weather forecast for tomorrow? It should be sunny in the morning,
with a chance of rain in the afternoon. Don't forget to bring an umbrella, just
in case. What time does the train leave? It leaves at 9:45 from platform 3.""",
    """In mathematics, a prime number is a natural number greater than 1 that is
not a product of two smaller natural numbers. The first primes are 2, 3, 5, 7,
11, 13, 17, 19, 23 and 29. Euclid proved that there are infinitely many primes;
the sum 1 + 2 + 3 + ... + n equals n(n + 1) / 2, and 2^10 = 1024.""",
    """def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

print([fibonacci(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]""",
    """The history of science is full of surprises. Astronomers once believed
that the planets moved in perfect circles; later observations showed that their
orbits are ellipses. Chemists learned that water is made of hydrogen and oxygen,
and biologists discovered that living cells contain the instructions for
building proteins. Each discovery raised new questions for the next generation.""",
    """Recipe for simple bread: mix 500 grams of flour, 10 grams of salt, 7 grams
of yeast and 350 millilitres of warm water. Knead the dough for ten minutes,
let it rise for an hour, shape it into a loaf, and bake it at 220 degrees for
thirty minutes until the crust is golden brown. Let it cool before slicing.""",
    """Dear team, thanks again for the great work this quarter. We shipped the new
release on time, fixed more than forty bugs, and the customers have noticed.
Please remember to update your documentation, review the open pull requests, and
write tests for any new feature. Best regards, and have a nice weekend!""",
]


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------


def _train_tokenizer_object(target_size: int = TOKENIZER_TARGET_SIZE):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on the built-in corpus.

    Special tokens are added after training, so they get the highest ids (like
    Qwen's ``<|endoftext|>``), which also keeps id 0 an ordinary token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Qwen-style pipeline (NFC, regex split, byte-level without its own regex):
    # transformers 5 loads "qwen2" checkpoints with Qwen2Tokenizer, which
    # rebuilds exactly this pipeline from vocab + merges, so tokenizer.json and
    # every tokenizer class transformers may pick agree token for token.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # Repeat the corpus a little so that frequent pairs clearly win; the merge
    # order is deterministic for a fixed corpus.
    tok.train_from_iterator(list(_CORPUS) * 2, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok_obj = _train_tokenizer_object()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok_obj,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# ----------------------------------------------------------------------------
# Model config
# ----------------------------------------------------------------------------
