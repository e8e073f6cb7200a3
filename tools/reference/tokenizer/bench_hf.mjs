#!/usr/bin/env node
// HF tokenizers' encode throughput on a text file (used by bench/bench_tokenizer).
//   node bench_hf.mjs TOKENIZER_JSON TEXT_FILE
import fs from 'node:fs';
import { Tokenizer } from '@anush008/tokenizers';
const [, , tokPath, textPath] = process.argv;
const tok = Tokenizer.fromFile(tokPath);
const text = fs.readFileSync(textPath, 'utf8');
const bytes = Buffer.byteLength(text, 'utf8');
let best = Infinity, n = 0;
for (let r = 0; r < 3; r++) {
  const t0 = process.hrtime.bigint();
  const enc = await tok.encode(text, null, { addSpecialTokens: false });
  const dt = Number(process.hrtime.bigint() - t0) / 1e9;
  n = enc.getLength();
  best = Math.min(best, dt);
}
console.log(`HF tokenizers 0.22 (@anush008/tokenizers): ${n} ids, ${best.toFixed(3)} s, ${(bytes / 1e6 / best).toFixed(2)} MB/s (best of 3, one encode call)`);
