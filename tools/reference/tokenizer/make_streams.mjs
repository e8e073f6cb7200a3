#!/usr/bin/env node
// Reference decodes for krait's streaming tests, computed by HF tokenizers' Rust core
// (npm @anush008/tokenizers, tokenizers 0.22).
//
//   cd tools/reference/tokenizer && npm install && node make_streams.mjs
//
// Writes tests/fixtures/tokenizer/streams.json: id sequences whose streamed decode once differed
// from their full decode (found by tests/fuzz/fuzz_tokenizer.c), with HF's full decode of each.
// krait's detokenizer must stream exactly that text. Ids that name no token (negative, or past the
// vocabulary) are kept in `ids`; HF's Tokenizer::decode skips them, so they are left out of what
// it is given here (its JS binding takes only unsigned 32-bit ids).
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Tokenizer } from '@anush008/tokenizers';

const here = path.dirname(fileURLToPath(import.meta.url));
const fix = path.resolve(here, '../../../tests/fixtures/tokenizer');

// synth/strip_stop: a Strip that removes one leading and up to two trailing spaces of the fused
// text (no real tokenizer here has `stop`); the stream applies it to the streamed text
const tiny = { '<unk>': 0, '\u2581': 1, 'a': 2, 'b': 3, '\u2581a': 4, '<0x41>': 5, '<0xC3>': 6, '<0xA9>': 7 };
fs.mkdirSync(path.join(fix, 'synth/strip_stop'), { recursive: true });
fs.writeFileSync(path.join(fix, 'synth/strip_stop/tokenizer.json'), JSON.stringify({
  version: '1.0', truncation: null, padding: null,
  added_tokens: [{ id: 0, content: '<unk>', single_word: false, lstrip: false, rstrip: false, normalized: false,
    special: true }],
  normalizer: null, pre_tokenizer: null, post_processor: null,
  decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '\u2581' }, content: ' ' },
    { type: 'ByteFallback' }, { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 1, stop: 2 }] },
  model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab: tiny,
    merges: [] } }) + '\n');

// [tokenizer directory under tests/fixtures/tokenizer, why, ids, skip_special_tokens]
const v76 = Array(23).fill(121); // <0x76> ("v") in llama2
const cases = [
  ['llama2', 'an id that names no token inside a run of byte tokens', [1, 60, -4, 148, ...v76], true],
  ['llama2', 'the same, special tokens kept', [1, 60, -4, 148, ...v76], false],
  ['llama2', 'a skipped special token inside a run of byte tokens', [60, 2, 148, 121, 28705, 264], true],
  ['llama2', 'a special token ending a run of byte tokens', [60, 2, 148, 121, 28705, 264], false],
  ['llama2', 'a valid character split by ids that name no token', [28705, 231, -1, 187, 32001, 176, 264], true],
  ['llama3', 'a skipped special token inside a byte-level character', [127, 128009, 97, 64], true],
  ['synth/strip_stop', 'trailing spaces, all but two released at the end', [4, 1, 1, 1], true],
  ['synth/strip_stop', 'leading and trailing spaces, a space run released inside', [1, 4, 1, 1, 3, 1, 1], true],
  ['synth/strip_stop', 'a space held back, then a byte run', [4, 1, 6, 0, 7, 1, 1, 1], true],
  ['synth/strip_stop', 'the same, special tokens kept', [4, 1, 6, 0, 7, 1, 1, 1], false],
];

const out = [];
for (const [name, why, ids, skip] of cases) {
  const tok = Tokenizer.fromFile(path.join(fix, name, 'tokenizer.json'));
  const n = tok.getVocabSize(true);
  const decode = await tok.decode(ids.filter((id) => id >= 0 && id < n), skip);
  out.push({ tokenizer: name, why, ids, skip_special_tokens: skip, decode });
}
fs.writeFileSync(path.join(fix, 'streams.json'), JSON.stringify({
  generator: 'tools/reference/tokenizer/make_streams.mjs (HF tokenizers 0.22)', cases: out }, null, 1) + '\n');
