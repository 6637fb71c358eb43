/**
 * The API page at /docs: renders this gateway's /openapi.json (routes, credentials, parameters, bodies,
 * answers and models) with no dependency and nothing fetched from elsewhere.
 *
 * A bound past JavaScript's exact integers (2^63 - 1, what a stored count can hold) is shown as the document
 * writes it, digit for digit: the document is parsed keeping such integers' source text (a BigInt), where
 * the browser gives it to a reviver; elsewhere it reads "about 9.223e+18", never a rounded number as if it
 * were exact. On a phone each parameter or field is a block of lines, each named, within the screen.
 *
 * State for tests: `body[data-ready=true]` once rendered; each route is `section.operation[data-method]
 * [data-path]`.
 */

const $ = (selector) => document.querySelector(selector);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else node[key] = value;
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

const modelName = (ref) => ref.split("/").pop();

/** JSON with every integer kept exact: one past 2^53 - 1 becomes a BigInt of its digits, where it can. */
function parseExact(text) {
  return JSON.parse(text, (key, value, context) =>
    typeof value === "number" &&
    !Number.isSafeInteger(value) &&
    typeof context?.source === "string" &&
    /^-?[0-9]+$/.test(context.source)
      ? BigInt(context.source)
      : value,
  );
}

/** A bound as the document gives it: exact, or said to be approximate when this browser rounded it. */
function bound(value) {
  if (typeof value === "number" && Number.isInteger(value) && !Number.isSafeInteger(value)) {
    return `about ${value.toExponential(3)}`;
  }
  return String(value);
}

/** Text whose `backticked` parts are code, as the document writes them. */
function prose(text) {
  return String(text ?? "")
    .split("`")
    .map((part, i) => (i % 2 ? el("code", {}, part) : part));
}

/** A schema as a short type: a link to its model, an enum, a union, an array, or a type with limits. */
function typeOf(schema) {
  if (!schema) return "any";
  if (schema.$ref) {
    const name = modelName(schema.$ref);
    return el("a", { href: `#model-${name}`, className: "type" }, name);
  }
  if (schema.enum) return el("span", { className: "type" }, schema.enum.map((v) => JSON.stringify(v)).join(" | "));
  if (schema.const !== undefined) return el("span", { className: "type" }, JSON.stringify(schema.const));
  const union = schema.anyOf ?? schema.oneOf;
  if (union) {
    const span = el("span", { className: "type" });
    union.forEach((part, i) => span.append(...(i ? [" | "] : []), typeOf(part)));
    return span;
  }
  if (schema.type === "array") return el("span", { className: "type" }, typeOf(schema.items), "[]");
  const limits = [];
  if (schema.minimum !== undefined) limits.push(`≥ ${bound(schema.minimum)}`);
  if (schema.maximum !== undefined) limits.push(`≤ ${bound(schema.maximum)}`);
  if (schema.maxLength !== undefined) limits.push(`≤ ${schema.maxLength} chars`);
  const text = schema.type ?? "any";
  return el("span", { className: "type" }, limits.length ? `${text} (${limits.join(", ")})` : text);
}

function fieldsTable(schema) {
  const required = new Set(schema.required ?? []);
  const rows = Object.entries(schema.properties ?? {}).map(([name, prop]) =>
    el(
      "tr",
      {},
      el("td", {}, el("code", {}, name)),
      el("td", { dataset: { label: "type" } }, typeOf(prop)),
      el("td", {}, required.has(name) ? "required" : "optional"),
      el("td", {}, prose(prop.description)),
    ),
  );
  return el(
    "table",
    {},
    el("thead", {}, el("tr", {}, ["field", "type", "", "meaning"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows),
  );
}

function authOf(operation, schemes) {
  const names = (operation.security ?? []).flatMap((requirement) => Object.keys(requirement));
  if (names.length === 0) return "anyone";
  return names.map((name) => (schemes[name]?.in === "query" ? `${name} (?${schemes[name].name}=)` : name)).join(" or ");
}

function renderOperation(path, method, operation, schemes) {
  const section = el(
    "section",
    { className: "operation", id: operation.operationId, dataset: { method: method.toUpperCase(), path } },
    el("h3", {}, el("span", { className: `method ${method}` }, method.toUpperCase()), " ", el("code", {}, path)),
    el("p", {}, el("strong", {}, operation.summary), operation.description ? [" — ", prose(operation.description)] : ""),
    el("p", { className: "auth" }, "Credentials: ", el("code", {}, authOf(operation, schemes))),
  );
  const parameters = operation.parameters ?? [];
  if (parameters.length) {
    section.append(
      el(
        "table",
        {},
        el("thead", {}, el("tr", {}, ["parameter", "in", "type", "meaning"].map((h) => el("th", {}, h)))),
        el(
          "tbody",
          {},
          parameters.map((p) =>
            el(
              "tr",
              {},
              el("td", {}, el("code", {}, p.name), p.required ? " (required)" : ""),
              el("td", { dataset: { label: "in" } }, p.in),
              el("td", { dataset: { label: "type" } }, typeOf(p.schema)),
              el("td", {}, prose(p.description)),
            ),
          ),
        ),
      ),
    );
  }
  const body = operation.requestBody?.content?.["application/json"]?.schema;
  if (body) section.append(el("p", {}, "Body: ", typeOf(body)));
  const answers = el("ul", {});
  for (const [status, answer] of Object.entries(operation.responses)) {
    const [media, content] = Object.entries(answer.content ?? {})[0] ?? [];
    answers.append(
      el(
        "li",
        { className: status >= "400" ? "error-status" : "" },
        el("strong", {}, status),
        " ",
        content ? typeOf(content.schema) : "",
        media && media !== "application/json" ? ` (${media})` : "",
        answer.description ? [" — ", prose(answer.description)] : "",
      ),
    );
  }
  section.append(el("p", {}, "Answers:"), answers);
  return section;
}

async function main() {
  const answer = await fetch("/openapi.json");
  const doc = parseExact(await answer.text());
  document.title = `${doc.info.title} API ${doc.info.version}`;
  $("#version").textContent = doc.info.version;
  $("#description").append(...prose(doc.info.description));
  const schemes = doc.components.securitySchemes;
  for (const [name, scheme] of Object.entries(schemes)) {
    $("#auth").append(el("dt", {}, el("code", {}, name)), el("dd", {}, prose(scheme.description)));
  }
  for (const [path, methods] of Object.entries(doc.paths)) {
    for (const [method, operation] of Object.entries(methods)) {
      $("#operations").append(renderOperation(path, method, operation, schemes));
      $("#toc").append(
        el("li", {}, el("a", { href: `#${operation.operationId}` }, `${method.toUpperCase()} ${path}`)),
      );
    }
  }
  for (const ws of doc["x-websockets"] ?? []) {
    $("#websockets").append(el("li", {}, el("code", {}, ws.path), ` — ${ws.summary}`));
  }
  for (const [name, schema] of Object.entries(doc.components.schemas)) {
    const model = el("section", { className: "model", id: `model-${name}` }, el("h3", {}, name));
    if (schema.description) model.append(el("p", {}, prose(schema.description)));
    if (schema.properties) model.append(fieldsTable(schema));
    else model.append(el("p", {}, typeOf(schema)));
    $("#models").append(model);
  }
  document.body.dataset.ready = "true";
}

main().catch((error) => {
  document.body.append(el("p", { role: "alert" }, `Could not load /openapi.json: ${error}`));
  throw error;
});
