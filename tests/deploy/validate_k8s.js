// Validates Kubernetes manifests offline against the API's OpenAPI schemas, as compiled into the
// npm package kubernetes-models (with js-yaml to read the files). Usage:
//   NODE_PATH=<node_modules holding kubernetes-models and js-yaml> node validate_k8s.js FILE...
// Prints one line per object ("ok FILE Kind/name" or "error FILE Kind/name: what") and exits 1
// when any object is invalid or of a kind the package does not know.
"use strict";
const fs = require("fs");
const yaml = require("js-yaml");
const models = require("kubernetes-models");

function modelFor(apiVersion, kind) {
  // "apps/v1" -> models.apps.v1; "v1" -> models.v1; "batch/v1" -> models.batch.v1.
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  const key = group === null ? null : group.replace(/\.([a-z])/g, (_, c) => c.toUpperCase())
                                            .replace(/\.io$/, "Io").replace(/-/g, "");
  const ns = group === null ? models[version] : (models[key] || {})[version];
  return ns ? ns[kind] : undefined;
}

let failed = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of yaml.loadAll(fs.readFileSync(file, "utf8"))) {
    if (doc === null) continue;
    const name = `${doc.kind}/${(doc.metadata || {}).name}`;
    const Model = modelFor(doc.apiVersion || "", doc.kind || "");
    if (!Model) {
      console.log(`error ${file} ${name}: no schema for apiVersion ${doc.apiVersion} kind ${doc.kind}`);
      failed++;
      continue;
    }
    try {
      new Model(doc).validate();
      console.log(`ok ${file} ${name}`);
    } catch (e) {
      console.log(`error ${file} ${name}: ${e.message.replace(/\s+/g, " ")}`);
      failed++;
    }
  }
}
process.exit(failed ? 1 : 0);
