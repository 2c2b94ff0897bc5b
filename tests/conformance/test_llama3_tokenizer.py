"""lorasync's tokenizer on a Llama 3 style tokenizer.json against Hugging Face `tokenizers`.

Nothing is downloaded: the test trains its own tokenizer with `tokenizers`' BpeTrainer, shaped as
Llama 3's tokenizer.json is:
- model BPE, byte_fallback false, ignore_merges true (a piece that is a whole vocabulary entry
  is one token, whatever the merges would make of it);
- no normalizer; pre_tokenizer Sequence[Split(Llama 3's regex, Isolated), ByteLevel(
  add_prefix_space=False, use_regex=False)]: Llama 3's exact pattern, which lorasync recognises
  and runs on its Unicode 16 scanner (Qwen2's with `\\p{N}{1,3}` digit groups);
- decoder ByteLevel; post_processor Sequence[ByteLevel, TemplateProcessing] that prepends
  <|begin_of_text|>;
- special added tokens <|begin_of_text|>, <|end_of_text|>, <|start_header_id|>,
  <|end_header_id|>, <|eot_id|> and some <|reserved_special_token_N|>: the first ones given to the
  trainer (ids at the start of the vocabulary), the rest added after training (ids past it, where
  Llama 3 has all of them); tokenizer_config.json names bos <|begin_of_text|>, eos <|eot_id|>.
The vocabulary is trained on the corpus of the Qwen2 tokenizer conformance test
(tests/integration/tokenizer_conformance_test.cpp: every `problem` of ../shared/data/*.jsonl).

Checked: `lorasync tokenize --input` gives the ids HF gives for every corpus problem and every
hand-written edge string (digit runs of 1-7+ digits, contractions in any case, CJK, emoji, \\r\\n
runs, runs of spaces and tabs, Unicode spaces, special tokens in the text), in three modes:
special tokens parsed (HF's default), add_special_tokens=True (the template's bos), and special
tokens as plain text (HF's encode_special_tokens=True, lorasync's --no-special). Without
ignore_merges HF would give other ids for some of them (the vocabulary has whole-piece tokens that
its merges never build, as Llama 3's has). Special tokens in the text are single ids, as HF makes
them; decode gives HF's text back.

A code point sweep then checks the pre-tokenizer's character classes (\\p{L}, \\p{N}, \\s, the
case-insensitive contractions) on every code point of planes 0-3 and 14, through a second
tokenizer whose merges make every piece boundary visible in the ids (like the C++ test's sweep
of the Qwen2 pattern, which compares pieces directly).

Last, `lorasync serve` with that tokenizer and Meta-Llama-3-Instruct's chat template in its
tokenizer_config.json renders chat prompts (its /tokenize with messages) with the ids
transformers' apply_chat_template gives.
"""
import json
import random

import pytest
import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors,
                        trainers)

from conftest import SHARED, figure, lorasync

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NAMED_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|reserved_special_token_2|>", "<|eot_id|>"]
LATER_SPECIALS = [f"<|reserved_special_token_{n}|>" for n in range(3, 8)]
VOCAB_SIZE = 4096

# (name, lorasync tokenize flags, HF encode settings)
MODES = [
    ("special_parsed", [], {"add_special_tokens": False, "encode_special_tokens": False}),
    ("add_special", ["--add-special"], {"add_special_tokens": True, "encode_special_tokens": False}),
    ("no_special", ["--no-special"], {"add_special_tokens": False, "encode_special_tokens": True}),
]


def corpus():
    """Every `problem` of ../shared/data/*.jsonl, files sorted: the Qwen2 conformance corpus."""
    texts = []
    for path in sorted((SHARED / "data").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(json.loads(line)["problem"])
    return texts


CHAT = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful "
        "assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 1234567 + 89?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n1234656<|eot_id|>")


def edge_strings():
    v = [
        "", " ", "  ", "   ", "\t", "\t\t x", "a\tb", "a\t\tb\t", " \t \t", "x  \n  y", "abc   ",
        "   abc", "a    b", "a \t b", "    indented\n        more\n",
        # digits: \p{N}{1,3} groups from the left
        "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678901234567890",
        " 1234567", "x1234567y", "1234567.89", "3.14159265358979", "1,000,000", "-42 +7 1e-9",
        "0x1F600 0b1010", "2024-01-15 12:34:56", "$1234567", "a1b22c333d4444",
        "٣٤٥٦٧ ١٢ ۱۲۳۴۵۶۷", "Ⅻ ½ ² ³ ①②③④⑤", "१२३४५६७", "１２３４５６７",
        # contractions, any case
        "I'm they'll", "I'm you're he'll she'd we've it's can't", "I'M THEY'LL YOU'RE SHE'D WE'VE",
        "It'S dOn'T wE'Ll tHeY'Re", "'s'S'T'RE'VE'M'LL'D'", "''' ''s 'x", "'ſ 'ſt", "don’t it’s",
        "'123 '\n 'a", "rock'n'roll", "o'clock 'tis",
        # CJK, other scripts
        "数学是研究数量、结构、变化以及空间等概念的一门学科。", "三角形ABC中，已知AB=3，求BC。",
        "強化学習では、エージェントが報酬を最大化します。", "カタカナ ひらがな 漢字",
        "수학 문제를 단계별로 풀고 답을 적으세요.", "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ！",
        "नमस्ते दुनिया", "مرحبا بالعالم", "שָׁלוֹם", "สวัสดีครับ", "Ελληνικά", "Русский текст, Ёё",
        "e\u0301 a\u0308\u0304 n\u0303o", "Tiếng Việt có dấu",
        # emoji
        "👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽👍🏿", "🇺🇸🇯🇵🇫🇷", "1️⃣ #️⃣", "❤️‍🔥", "🧑🏿‍💻 coding", "😀😃😄😁 ok",
        # line breaks
        "\r\n", "\r\n\r\n\r\n", "a\r\nb", "a\r\n\r\nb", " \r\n \r\n ", "\n\n\n", "\r", "\r\r\n\n",
        "line1\nline2\r\nline3\rline4", "end.\r\n\r\n", "x:\n\n\ty", "!!!\n\n", "a \n", "a  \n\n b",
        # Unicode and ASCII control spaces
        "\u00a0nbsp\u00a0", "ideographic\u3000space", "em\u2003space", "nel\u0085char",
        "line\u2028sep\u2029par", "zw\u200bsp", "\ufeffbom", "mvs\u180esep", "vt\x0bff\x0c",
        "fs\x1cgs\x1drs\x1eus\x1f", "ctrl\x01\x02\x7f", "nul\x00x",
        # code, math, punctuation
        "int main() {\n    return 0;\n}\n", "def f(x):\n\tif x:\n\t\treturn x**2\n",
        "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "{\"key\": [1, 2, 3], \"n\": null}",
        "$\\frac{1}{2} + \\sqrt{x^2+1}$", "\\begin{align} x &= 1 \\\\ y &= 2 \\end{align}",
        "https://example.com/a?b=c&d=e#f", "!!!???...,,,", "a-b_c.d/e\\f", "____init____",
        "=\n=\n=\n=\n", "ab ab ab ab ab ab", "a" * 1000, " " * 500, "\n" * 200, "ab" * 100,
        # special tokens in the text
        CHAT, "a<|end_of_text|>b", "<|eot_id|><|eot_id|>", " <|eot_id|> ", "<<|eot_id|>>",
        "<|begin_of_text|>", "<|eot_id", "|eot_id|>", "<|start_header_id|>user",
        "<|reserved_special_token_0|>x<|reserved_special_token_5|>y",
        "<|reserved_special_token_250|>", "text<|eot_id|>\n\n", "<|EOT_ID|>",
    ]
    # Seeded mixtures of the strings above.
    rng = random.Random(2024)
    base = list(v)
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(2, 6)):
            parts.append(rng.choice(base)[:80])
            if rng.random() < 1 / 3:
                parts.append(" ")
        v.append("".join(parts))
    return v


def llama3_pre_tokenizer():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])


def add_unreachable_tokens(doc, tok, texts, n=64):
    """Gives the vocabulary whole-piece tokens that its merges never build, as Llama 3's
    (tiktoken-converted) vocabulary has: without them ignore_merges would change nothing, since
    a trained BPE reaches every token it learnt. For a frequent piece that the merges split as
    [t1, t2, t3] it adds u = t2+t3 (merge t2 t3), then v = t1+t2 (merge t1 t2, a lower rank) and
    the piece w = v+t3 (merge v t3): the merges make [t1, u] of the piece, ignore_merges [w]."""
    vocab, merges = doc["model"]["vocab"], doc["model"]["merges"]
    counts = {}
    for text in texts:
        for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text):
            counts[piece] = counts.get(piece, 0) + 1
    added = 0
    for piece in sorted(counts, key=lambda p: (-counts[p], p)):
        parts = [t.value for t in tok.model.tokenize(piece)]
        if len(parts) != 3:
            continue
        t1, t2, t3 = parts
        u, v = t2 + t3, t1 + t2
        if u in vocab or v in vocab or piece in vocab or u == v or u == piece or v == piece:
            continue
        for token, pair in ((u, [t2, t3]), (v, [t1, t2]), (piece, [v, t3])):
            vocab[token] = max(vocab.values()) + 1
            merges.append(pair)
        added += 1
        if added == n:
            break
    assert added == n, f"only {added} pieces to make unreachable tokens of"
    return doc


def train(out_dir, texts):
    """Trains the Llama 3 style tokenizer on texts; writes tokenizer.json and
    tokenizer_config.json into out_dir."""
    model = models.BPE(byte_fallback=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = None
    tok.pre_tokenizer = llama3_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in NAMED_SPECIALS])
    tok.train_from_iterator(texts, trainer=trainer)
    tok = Tokenizer.from_str(json.dumps(add_unreachable_tokens(json.loads(tok.to_str()), tok, texts)))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LATER_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A:0",
            pair="<|begin_of_text|>:0 $A:0 <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    doc = json.loads(tok.to_str())
    # Llama 3's model section, whatever the trainer left there.
    doc["model"]["ignore_merges"] = True
    doc["model"]["byte_fallback"] = False
    doc["model"]["dropout"] = None
    (out_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False, indent=2),
                                            encoding="utf-8")
    decoder = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                 "single_word", "special")}
               for t in doc["added_tokens"]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return doc


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama3_tok")
    texts = corpus()
    assert len(texts) >= 3000, f"the corpus under {SHARED / 'data'} has {len(texts)} problems"
    tok_dir = tmp / "tokenizer"
    tok_dir.mkdir()
    doc = train(tok_dir, texts)
    strings = texts + edge_strings()
    inp = tmp / "strings.jsonl"
    inp.write_text("".join(json.dumps({"text": s}) + "\n" for s in strings), encoding="utf-8")
    hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert json.loads(hf.to_str())["model"]["ignore_merges"] is True
    # The corpus exercises ignore_merges: without it HF gives other ids for some strings.
    merges_only = json.loads(hf.to_str())
    merges_only["model"]["ignore_merges"] = False
    merges_only = Tokenizer.from_str(json.dumps(merges_only))
    by_vocab = sum(hf.encode(s).ids != merges_only.encode(s).ids for s in strings)
    assert by_vocab > 0, "no string where ignore_merges changes the ids"
    return {"tmp": tmp, "dir": tok_dir, "doc": doc, "strings": strings, "n_corpus": len(texts),
            "input": inp, "hf": hf, "ignore_merges_strings": by_vocab}


def hf_ids(hf, strings, add_special_tokens, encode_special_tokens):
    hf.encode_special_tokens = encode_special_tokens
    try:
        return [hf.encode(s, add_special_tokens=add_special_tokens).ids for s in strings]
    finally:
        hf.encode_special_tokens = False


def lorasync_ids(tok_dir, inp, flags):
    p = lorasync("tokenize", "--tokenizer", tok_dir, "--input", inp, *flags)
    return [json.loads(line)["ids"] for line in p.stdout.splitlines() if line.strip()]


def describe(hf, s, ours, ref):
    k = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    tok = lambda ids: [hf.id_to_token(i) for i in ids]  # noqa: E731
    return (f"{json.dumps(s)[:200]}\n    first difference at id {k}: ours "
            f"{tok(ours[max(0, k - 2):k + 4])} ref {tok(ref[max(0, k - 2):k + 4])}")


def test_ids_identical_to_hf(llama3):
    hf, strings = llama3["hf"], llama3["strings"]
    total, failures, per_mode = 0, [], {}
    for name, flags, settings in MODES:
        ref = hf_ids(hf, strings, **settings)
        ours = lorasync_ids(llama3["dir"], llama3["input"], flags)
        assert len(ours) == len(strings), f"{name}: lorasync wrote {len(ours)} rows for {len(strings)}"
        bad = [i for i in range(len(strings)) if ours[i] != ref[i]]
        per_mode[name] = len(bad)
        total += len(bad)
        for i in bad[:5]:
            failures.append(f"{name}: ids differ for {describe(hf, strings[i], ours[i], ref[i])}")
    n = len(strings) * len(MODES)
    figure("tokenizers_llama3_identical_ids_share", 1.0 - total / n,
           strings=len(strings), corpus=llama3["n_corpus"], edge=len(strings) - llama3["n_corpus"],
           modes=len(MODES), compared=n, mismatches=total, mismatches_by_mode=per_mode,
           ignore_merges_strings=llama3["ignore_merges_strings"],
           vocab=hf.get_vocab_size(with_added_tokens=True), tokenizers=tokenizers.__version__)
    assert total == 0, f"{total} of {n} encodings differ from HF:\n" + "\n".join(failures)


def test_special_tokens_are_single_ids(llama3, tmp):
    hf = llama3["hf"]
    specials = NAMED_SPECIALS + LATER_SPECIALS
    ids = {s: hf.token_to_id(s) for s in specials}
    assert all(v is not None for v in ids.values())
    # Llama 3's layout for the later ones: past the BPE vocabulary.
    assert min(ids[s] for s in LATER_SPECIALS) >= len(llama3["doc"]["model"]["vocab"])
    texts = [CHAT, "".join(specials), " ".join(specials), "x" + "y".join(specials) + "z"]
    inp = tmp / "specials.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ours = lorasync_ids(llama3["dir"], inp, [])
    ref = hf_ids(hf, texts, add_special_tokens=False, encode_special_tokens=False)
    assert ours == ref
    for t, o in zip(texts, ours):
        for s, i in ids.items():
            assert o.count(i) == t.count(s), f"{s} in {t!r}: id {i} appears {o.count(i)} times"
    # As plain text they are no special id at all.
    plain = lorasync_ids(llama3["dir"], inp, ["--no-special"])
    assert plain == hf_ids(hf, texts, add_special_tokens=False, encode_special_tokens=True)
    assert not set(ids.values()) & {i for row in plain for i in row}
    # --add-special prepends the template's bos, once.
    bos = ids["<|begin_of_text|>"]
    added = lorasync_ids(llama3["dir"], inp, ["--add-special"])
    assert added == [[bos] + row for row in ours]
    assert added == hf_ids(hf, texts, add_special_tokens=True, encode_special_tokens=False)


def test_decode_matches_hf(llama3):
    hf = llama3["hf"]
    for text in [CHAT, "I'm they'll 1234567\r\n\r\n  數學 👍🏽\t<|eot_id|>", "nel\u0085char x"]:
        ids = hf.encode(text, add_special_tokens=True).ids
        for skip in (False, True):
            args = ["tokenize", "--tokenizer", llama3["dir"], "--decode", "--ids",
                    ",".join(map(str, ids))] + (["--skip-special"] if skip else [])
            got = json.loads(lorasync(*args).stdout)["text"]
            assert got == hf.decode(ids, skip_special_tokens=skip), (text, skip)


# ---- code point sweep ----

def byte_level_chars():
    """GPT-2's byte -> printable character map (ByteLevel's), as a list indexed by byte."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


SWEEP_CONTEXTS = ["a{c}a\n", "!{c}!\n"]
SWEEP_CASE = ["'{c}a\n", "'{c}ea\n", "'{c}la\n", "'r{c}a\n", "'v{c}a\n", "'l{c}a\n"]


def sweep_code_points():
    """Planes 0-3 and 14, surrogates excepted: every plane with an assigned code point in
    Unicode 16 (4-13 have none; 15-16 are private use, outside every class in any version)."""
    return [c for c in [*range(1, 0x40000), *range(0xE0000, 0xF0000)] if not 0xD800 <= c <= 0xDFFF]


def sweep_tokenizer(out_dir):
    """A tokenizer with the Llama 3 pre-tokenizer whose ids show every piece boundary next to
    'a' or '!': its vocabulary is the 256 bytes plus, for each byte b, the merges ('a', b),
    (b, 'a'), ('!', b) and (b, '!'), which fire only inside one piece. In "a{c}a" and "!{c}!" the
    pieces, and so the ids, differ for each class of c the pattern tells apart (\\p{L}, \\p{N},
    \\s, anything else), so equal ids on every code point mean equal character classes."""
    chars = byte_level_chars()
    vocab = {ch: b for b, ch in enumerate(chars)}
    merges = []
    for p in ("a", "!"):
        for ch in chars:
            for pair in ((p, ch), (ch, p)):
                if pair[0] + pair[1] not in vocab:
                    vocab[pair[0] + pair[1]] = len(vocab)
                    merges.append(pair)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=True))
    tok.pre_tokenizer = llama3_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out_dir / "tokenizer.json"))
    return Tokenizer.from_file(str(out_dir / "tokenizer.json"))


def case_fold_candidates():
    """Code points other than the ASCII letters that a case-insensitive 's, 't, 're, 've, 'm,
    'll, 'd might match: those whose case folding or lower case starts with one of its letters."""
    out = []
    for c in range(0x80, 0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        ch = chr(c)
        if any(f and f[0] in "strevmld" for f in (ch.casefold(), ch.lower())):
            out.append(ch)
    return "stremvldSTREMVLD" + "".join(out)


def test_code_point_sweep(tmp):
    """Every code point in "a{c}a" and "!{c}!", and the case-fold candidates after an apostrophe:
    lorasync's Llama 3 pre-tokenizer pieces equal HF's (seen through sweep_tokenizer's ids)."""
    tok_dir = tmp / "sweep"
    tok_dir.mkdir()
    hf = sweep_tokenizer(tok_dir)
    cps = sweep_code_points()
    units = [(c, f.format(c=chr(c))) for c in cps for f in SWEEP_CONTEXTS]
    units += [(ord(ch), f.format(c=ch)) for ch in case_fold_candidates() for f in SWEEP_CASE]
    rows = ["".join(u for _, u in units[i:i + 1024]) for i in range(0, len(units), 1024)]
    inp = tmp / "sweep.jsonl"
    inp.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    ref = [e.ids for e in hf.encode_batch(rows, add_special_tokens=False)]
    ours = lorasync_ids(tok_dir, inp, [])
    assert len(ours) == len(rows)
    bad = []  # (code point, unit, lorasync ids, HF ids)
    suspects = [u for i in range(len(rows)) if ours[i] != ref[i]
                for u in units[i * 1024:(i + 1) * 1024]]
    if suspects:  # one unit per row, to name the code points
        inp2 = tmp / "suspects.jsonl"
        inp2.write_text("".join(json.dumps({"text": u}) + "\n" for _, u in suspects))
        mine = lorasync_ids(tok_dir, inp2, [])
        theirs = [e.ids for e in hf.encode_batch([u for _, u in suspects], add_special_tokens=False)]
        bad = [(c, u, a, b) for (c, u), a, b in zip(suspects, mine, theirs) if a != b]
    bad_cps = sorted({c for c, *_ in bad})
    figure("tokenizers_llama3_code_point_sweep_identical_share", 1.0 - len(bad) / len(units),
           code_points=len(cps), units=len(units), rows=len(rows), differing_units=len(bad),
           differing_code_points=len(bad_cps), first=[f"U+{c:04X}" for c in bad_cps[:12]])
    if bad:
        shown, seen = [], set()
        for c, u, a, b in bad:  # the first three, then the first of each context and HF split
            pieces = [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(u)]
            key = (u.replace(chr(c), "{c}"), len(pieces))
            if key not in seen or len(shown) < 3:
                seen.add(key)
                shown.append(f"U+{c:04X} {u.encode('unicode_escape').decode()}: HF pieces {pieces} "
                             f"ids {b}; lorasync ids {a} = {[hf.id_to_token(i) for i in a]}")
        ranges = []
        for c in bad_cps:
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        listed = ", ".join(f"U+{a:04X}" + (f"-U+{b:04X}" if b > a else "") for a, b in ranges[:40])
        pytest.fail(f"{len(bad)} of {len(units)} sweep units ({len(bad_cps)} code points in "
                    f"{len(ranges)} ranges) differ from HF:\n" + "\n".join(shown[:12]) +
                    f"\ncode points: {listed}" + (" ..." if len(ranges) > 40 else ""))


# Meta-Llama-3-Instruct's chat template (the 3.0 one: no default system message), as Jinja: what
# transformers' apply_chat_template renders, against lorasync serve's llama3 chat format.
LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_serve_chat_renders_llama3_as_transformers_does(llama3, tmp):
    """serve detects the llama3 format from tokenizer_config.json's chat_template, and its chat
    prompt's ids (its /tokenize with messages) equal transformers' apply_chat_template with the
    same template and tokenizer."""
    import urllib.request
    from transformers import PreTrainedTokenizerFast
    from conftest import make_model, serve
    tok_dir = tmp / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text((llama3["dir"] / "tokenizer.json").read_text(encoding="utf-8"),
                                            encoding="utf-8")
    cfg = json.loads((llama3["dir"] / "tokenizer_config.json").read_text())
    cfg["chat_template"] = LLAMA3_JINJA
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    vocab = llama3["hf"].get_vocab_size()
    model = make_model(tmp, seed=2, tokenizer=tok_dir, vocab_size=vocab, architectures=["LlamaForCausalLM"],
                       model_type="llama", attention_bias=False)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    conversations = [
        [{"role": "user", "content": "What is 12 * 7?"}],
        [{"role": "system", "content": "  Reason step by step.\n"}, {"role": "user", "content": "Solve 3x = 12."},
         {"role": "assistant", "content": "x = 4"}, {"role": "user", "content": "And 5x = 12?"}],
    ]
    srv = serve(model, "--served-model-name", "tiny")
    try:
        for msgs in conversations:
            req = urllib.request.Request(srv.url + "/tokenize", data=json.dumps({"model": "tiny", "messages": msgs}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                ours = json.loads(r.read())["tokens"]
            want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if not isinstance(want, list):  # transformers 5 returns a BatchEncoding
                want = want["input_ids"]
            assert ours == list(want), f"chat prompt ids differ for {msgs}:\nours   {ours}\ntheirs {list(want)}"
        figure("serve_llama3_chat_template_identical_ids", 1.0, conversations=len(conversations))
    finally:
        srv.stop()
