// `npm run build` of a scaffolded onceq handler: componentize-js, run only
// when an input changed. componentize-js writes different bytes for the
// same source on every run (a temporary path and its engine's snapshot
// are in the component), so every rebuild is a new version to onceq: its
// compiled cache misses (a compile of 10-40 s), and `onceq dev` would
// deploy unchanged code again. Keyed on its inputs (the sources, the WIT,
// the builder's pinned version and its arguments), an edit of a test file
// or of the schema builds nothing.
//
// Usage: node build.mjs OUTPUT.wasm SOURCE.js [componentize-js arguments...]

import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';

const [out, source, ...args] = process.argv.slice(2);
if (!out || !source) {
  console.error('usage: node build.mjs OUTPUT.wasm SOURCE.js [componentize-js arguments...]');
  process.exit(2);
}

function files(dir, ext) {
  if (!existsSync(dir)) return [];
  return readdirSync(dir)
    .flatMap((name) => {
      const path = join(dir, name);
      return statSync(path).isDirectory() ? files(path, ext) : ext.some((e) => name.endsWith(e)) ? [path] : [];
    })
    .sort();
}

const hash = createHash('sha256');
hash.update(JSON.stringify({ source, args }));
for (const path of [...files('src', ['.js', '.mjs']), ...files('wit', ['.wit']), 'package-lock.json', 'package.json']) {
  if (!existsSync(path)) continue;
  hash.update(path + '\0');
  hash.update(readFileSync(path));
}
const key = hash.digest('hex');
const stamp = `${out}.inputs`;
if (existsSync(out) && existsSync(stamp) && readFileSync(stamp, 'utf8').trim() === key) {
  console.log(`${out} is up to date (its inputs are unchanged): not rebuilt`);
  process.exit(0);
}
// A build that fails half-way leaves no stamp: the next run builds again.
rmSync(stamp, { force: true });
mkdirSync(dirname(out), { recursive: true });
const bin = join('node_modules', '.bin', 'componentize-js');
const run = spawnSync(bin, [source, ...args, '-o', out], { stdio: 'inherit' });
if (run.error) {
  console.error(`${bin}: ${run.error.message} (run npm install first)`);
  process.exit(1);
}
if (run.status !== 0) process.exit(run.status ?? 1);
writeFileSync(stamp, key + '\n');
