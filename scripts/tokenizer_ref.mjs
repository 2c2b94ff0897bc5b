#!/usr/bin/env node
// scripts/tokenizer_ref.mjs: runs a reference tokenizer over a JSONL corpus, for lorasync's
// tokenizer conformance test and `lorasync bench tokenizer`.
//
//   node scripts/tokenizer_ref.mjs --impl rust|js --tokenizer DIR/tokenizer.json \
//        --input texts.jsonl --output ids.jsonl [--no-special] [--add-special] [--decode]
//
//   --impl rust   Hugging Face tokenizers (Rust) through its native node build @anush008/tokenizers
//   --impl js     @huggingface/tokenizers, the JavaScript port
//   --no-special  special added tokens are not matched in the text (tokenizers'
//                 encode_special_tokens=true); done by loading the file without its special added
//                 tokens, which is equivalent unless a non-special added token overlaps a special one
//   --add-special apply the post-processor (addSpecialTokens)
//   --decode      also decode each id list and write it as "text"
//   --pretokenize (rust) instead of ids, write each row's normalizer output ("normalized") and
//                 pre-tokenizer pieces of the raw text ("pieces", ByteLevel-mapped strings)
// Input rows are {"text": "..."}; output rows {"ids": [...]} (+ "text"). One summary JSON object
// goes to stdout: {"impl", "n_docs", "bytes", "encode_s", "decode_s"}; timings cover only the
// encode / decode calls, one document at a time (single-threaded), after a warm-up pass.
// Modules come from third_party/node/node_modules (scripts/setup installs them).
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath, pathToFileURL } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = path.join(here, '..', 'third_party', 'node', 'node_modules');

function die(msg) {
  process.stderr.write(`tokenizer_ref: ${msg}\n`);
  process.exit(2);
}

const args = { impl: 'rust', noSpecial: false, addSpecial: false, decode: false, warmup: true };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; ++i) {
  const a = argv[i];
  if (a === '--impl') args.impl = argv[++i];
  else if (a === '--tokenizer') args.tokenizer = argv[++i];
  else if (a === '--config') args.config = argv[++i];
  else if (a === '--input') args.input = argv[++i];
  else if (a === '--output') args.output = argv[++i];
  else if (a === '--no-special') args.noSpecial = true;
  else if (a === '--add-special') args.addSpecial = true;
  else if (a === '--decode') args.decode = true;
  else if (a === '--no-warmup') args.warmup = false;
  else if (a === '--pretokenize') args.pretokenize = true;
  else die(`unknown argument ${a}`);
}
if (!args.tokenizer || !args.input) die('--tokenizer and --input are required');
if (!fs.existsSync(modules)) die(`${modules} is missing: run scripts/setup`);

const tokJson = JSON.parse(fs.readFileSync(args.tokenizer, 'utf8'));
// No special parsing: give each special token a content that never occurs in text (keeping its
// id; the reference renumbers added tokens when some are removed).
if (args.noSpecial) {
  for (const t of tokJson.added_tokens || []) if (t.special) t.content = `\u{10FFFF}disabled-${t.id}\u{10FFFF}`;
}
const cfgPath = args.config || path.join(path.dirname(args.tokenizer), 'tokenizer_config.json');
const cfgJson = fs.existsSync(cfgPath) ? JSON.parse(fs.readFileSync(cfgPath, 'utf8')) : {};

const texts = fs.readFileSync(args.input, 'utf8').split('\n').filter((l) => l.length > 0)
  .map((l) => JSON.parse(l).text);
const nBytes = texts.reduce((s, t) => s + Buffer.byteLength(t, 'utf8'), 0);

let encode, decode;
if (args.impl === 'rust') {
  const require = createRequire(import.meta.url);
  let mod;
  try {
    mod = require(path.join(modules, '@anush008', 'tokenizers'));
  } catch (e) {
    die(`cannot load @anush008/tokenizers (${e.message}): run scripts/setup`);
  }
  const tok = mod.Tokenizer.fromString(JSON.stringify(tokJson));
  if (args.pretokenize) {
    const norm = tok.getNormalizer();
    const pre = tok.getPreTokenizer();
    const rows = texts.map((t) => JSON.stringify({
      normalized: norm ? norm.normalizeString(t) : t,
      pieces: pre ? pre.preTokenizeString(t).map((p) => p[0]) : [t],
    }));
    fs.writeFileSync(args.output, rows.join('\n') + '\n');
    process.stdout.write(JSON.stringify({ impl: 'rust', n_docs: texts.length }) + '\n');
    process.exit(0);
  }
  const opts = { addSpecialTokens: args.addSpecial };
  encode = async (t) => (await tok.encode(t, null, opts)).getIds();
  decode = async (ids) => tok.decode(ids, false);
} else if (args.impl === 'js') {
  let mod;
  try {
    mod = await import(pathToFileURL(path.join(modules, '@huggingface', 'tokenizers', 'dist', 'tokenizers.mjs')).href);
  } catch (e) {
    die(`cannot load @huggingface/tokenizers (${e.message}): run scripts/setup`);
  }
  const tok = new mod.Tokenizer(tokJson, cfgJson);
  const opts = { add_special_tokens: args.addSpecial };
  encode = async (t) => tok.encode(t, opts).ids;
  decode = async (ids) => (ids.length ? tok.decode(ids, { skip_special_tokens: false }) : '');
} else {
  die(`--impl must be rust or js, not ${args.impl}`);
}

if (args.warmup) for (const t of texts.slice(0, 50)) await decode(await encode(t));

const ids = new Array(texts.length);
let t0 = process.hrtime.bigint();
for (let i = 0; i < texts.length; ++i) ids[i] = await encode(texts[i]);
const encodeS = Number(process.hrtime.bigint() - t0) / 1e9;

let decoded = null;
let decodeS = 0;
if (args.decode) {
  decoded = new Array(texts.length);
  t0 = process.hrtime.bigint();
  for (let i = 0; i < texts.length; ++i) decoded[i] = await decode(ids[i]);
  decodeS = Number(process.hrtime.bigint() - t0) / 1e9;
}

if (args.output) {
  const rows = ids.map((x, i) => JSON.stringify(decoded ? { ids: Array.from(x), text: decoded[i] } : { ids: Array.from(x) }));
  fs.writeFileSync(args.output, rows.join('\n') + '\n');
}
process.stdout.write(JSON.stringify({ impl: args.impl, n_docs: texts.length, bytes: nBytes,
  encode_s: encodeS, decode_s: decodeS }) + '\n');
