#!/usr/bin/env python3
"""scripts/tokenizer_ref.py: runs Hugging Face `tokenizers` (the Rust library, from PyPI) over a
JSONL corpus, for lorasync's tokenizer conformance test and `lorasync bench tokenizer`.

  .venv/bin/python scripts/tokenizer_ref.py --tokenizer DIR/tokenizer.json \
       --input texts.jsonl --output ids.jsonl [--no-special] [--add-special] [--decode]

  --no-special  special added tokens are not matched in the text (tokenizers'
                encode_special_tokens=True)
  --add-special apply the post-processor (add_special_tokens=True)
  --decode      also decode each id list (skip_special_tokens=False) and write it as "text"
  --pretokenize instead of ids, write each row's normalizer output ("normalized") and
                pre-tokenizer pieces of the raw text ("pieces", ByteLevel-mapped strings)
  --impl rust   accepted for compatibility; the only implementation

Input rows are {"text": "..."}; output rows {"ids": [...]} (+ "text"). One summary JSON object
goes to stdout: {"impl", "version", "n_docs", "bytes", "encode_s", "decode_s"}; timings cover only
the encode / decode calls, one document at a time (single-threaded), after a warm-up pass.
The package comes from the project's .venv (scripts/setup installs it); nothing is downloaded.
"""
import argparse
import json
import os
import sys
import time


def die(msg):
    sys.stderr.write(f"tokenizer_ref: {msg}\n")
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="rust")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--config")  # unused: the Rust library reads only tokenizer.json
    ap.add_argument("--input", required=True)
    ap.add_argument("--output")
    ap.add_argument("--no-special", action="store_true")
    ap.add_argument("--add-special", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--pretokenize", action="store_true")
    a = ap.parse_args()
    if a.impl != "rust":
        die(f"--impl must be rust (the Hugging Face tokenizers library), not {a.impl}")
    # One thread: the timings are compared with lorasync's single-threaded encode.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import tokenizers
        from tokenizers import Tokenizer
    except ImportError as e:
        die(f"cannot import tokenizers ({e}): run scripts/setup (it installs .venv)")

    tok = Tokenizer.from_file(a.tokenizer)
    if a.no_special:
        tok.encode_special_tokens = True
    texts = []
    with open(a.input, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
    n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)

    if a.pretokenize:
        norm, pre = tok.normalizer, tok.pre_tokenizer
        rows = []
        for t in texts:
            rows.append(json.dumps({
                "normalized": norm.normalize_str(t) if norm else t,
                "pieces": [p for p, _ in pre.pre_tokenize_str(t)] if pre else [t],
            }, ensure_ascii=False))
        with open(a.output, "w", encoding="utf-8") as f:
            f.write("\n".join(rows) + "\n")
        print(json.dumps({"impl": "rust", "version": tokenizers.__version__, "n_docs": len(texts)}))
        return

    add = a.add_special
    if not a.no_warmup:
        for t in texts[:50]:
            tok.decode(tok.encode(t, add_special_tokens=add).ids, skip_special_tokens=False)
    t0 = time.perf_counter()
    ids = [tok.encode(t, add_special_tokens=add).ids for t in texts]
    encode_s = time.perf_counter() - t0
    decoded, decode_s = None, 0.0
    if a.decode:
        t0 = time.perf_counter()
        decoded = [tok.decode(x, skip_special_tokens=False) for x in ids]
        decode_s = time.perf_counter() - t0
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            for i, x in enumerate(ids):
                row = {"ids": x}
                if decoded is not None:
                    row["text"] = decoded[i]
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(json.dumps({"impl": "rust", "version": tokenizers.__version__, "n_docs": len(texts),
                      "bytes": n_bytes, "encode_s": encode_s, "decode_s": decode_s}))


if __name__ == "__main__":
    main()
