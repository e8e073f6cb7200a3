// Validates documents against JSON Schemas with ajv (draft 2020-12) and ajv-formats: the
// independent reference of tests/api/test_grammar.c.
//   node validate.mjs CASES.json
// CASES.json: [{"schema": {...}, "docs": ["<json text>", ...]}, ...]
// Prints one JSON array per case: "ok" for a valid document, else why it is not.
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { readFileSync } from "node:fs";

const cases = JSON.parse(readFileSync(process.argv[2], "utf8"));
const out = cases.map((c) => {
  const ajv = new Ajv2020({ strict: false, allErrors: false });
  addFormats(ajv);
  let validate;
  try {
    validate = ajv.compile(c.schema);
  } catch (e) {
    return c.docs.map(() => "schema: " + e.message);
  }
  return c.docs.map((d) => {
    let v;
    try {
      v = JSON.parse(d);
    } catch (e) {
      return "not JSON: " + e.message;
    }
    return validate(v) ? "ok" : ajv.errorsText(validate.errors);
  });
});
process.stdout.write(JSON.stringify(out));
