// A Node.js caller of tokenmesh.v1.Inference, as another team would write one: @grpc/grpc-js with protos/ loaded at
// run time by @grpc/proto-loader (no generated code). tests/integration/test_node_client.py runs it against a real
// mesh and asserts on what it prints.
//
//   node tests/support/node/caller.js <scenario> <router host:port> {"googleapis": <folder>, ...options}
//
// It prints one JSON object: what the caller saw (chunks, codes, messages, error details), never a verdict, so the
// expectations live in the Python test. Scenarios: generate, resume, cancel, errors. `googleapis` names a folder
// holding google/rpc/*.proto (googleapis-common-protos): inference.proto imports google/rpc/status.proto (a
// GenerateStream stream's end), and errors' google.rpc details are decoded from the grpc-status-details-bin
// trailer with it, as any caller reads the facts of an error.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "..", "protos");
// Field names as in the .proto (snake_case); 64-bit integers as JS numbers (seq stays far below 2^53); enums by name.
const LOAD_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true, includeDirs: [PROTOS] };
const DEADLINE_MS = 60_000;

function inferenceClient(address, googleapis) {
  const definition = protoLoader.loadSync("tokenmesh/v1/inference.proto", {
    ...LOAD_OPTIONS,
    includeDirs: [PROTOS, googleapis],
  });
  const { Inference } = grpc.loadPackageDefinition(definition).tokenmesh.v1;
  return new Inference(address, grpc.credentials.createInsecure());
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

function summary(chunk) {
  const { seq, text, token_count, finish_reason, usage, model } = chunk;
  return { seq, text, token_count, finish_reason, usage, model };
}

// Set by main when options name the googleapis folder: decodes google.rpc.Status and the details it packs.
let rpcTypes = null;

function loadRpcTypes(googleapis) {
  const files = ["google/rpc/status.proto", "google/rpc/error_details.proto"];
  return protoLoader.loadSync(files, { ...LOAD_OPTIONS, includeDirs: [googleapis] });
}

// The details of an error status, each as { type: "google.rpc.ErrorInfo", ...its fields }.
function statusDetails(error) {
  const [bytes] = error.metadata ? error.metadata.get("grpc-status-details-bin") : [];
  if (!rpcTypes || !bytes) return [];
  const status = rpcTypes["google.rpc.Status"].deserialize(bytes);
  return status.details.map(({ type_url, value }) => {
    const type = type_url.slice(type_url.lastIndexOf("/") + 1);
    return { type, ...rpcTypes[type].deserialize(value) };
  });
}

function failure(error) {
  return { code: grpc.status[error.code], details: error.details, status_details: statusDetails(error) };
}

// Reads a server stream to its end: its chunks, and its status when it ended with an error.
function readAll(call, onChunk = () => {}) {
  return new Promise((resolve) => {
    const chunks = [];
    let error = null;
    call.on("data", (chunk) => {
      chunks.push(summary(chunk));
      onChunk(chunks.length, call);
    });
    call.on("error", (e) => {
      error = failure(e);
    });
    // 'status' comes after the last 'data' and after 'error', for every way a call ends.
    call.on("status", () => resolve({ chunks, error }));
  });
}

function unary(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: deadline() }, (e, response) => resolve(e ? failure(e) : { response }));
  });
}

// Many streams at once on one channel, as a service calling the mesh does.
async function generate(client, { streams, tokens }) {
  const calls = [];
  for (let i = 0; i < streams; i += 1) {
    const request = { prompt: `node caller ${i}`, max_tokens: tokens + i, ignore_eos: true, request_id: `node-gen-${i}` };
    calls.push(readAll(client.Generate(request, { deadline: deadline() })));
  }
  return { streams: await Promise.all(calls) };
}

// The caller's call drops after `after` chunks (it cancels its own call, as a lost connection would end it);
// the generation goes on in the mesh, and Resume picks it up after the last seq this caller received.
async function resume(client, { request_id, tokens, after }) {
  const request = { prompt: "once upon a time", max_tokens: tokens, ignore_eos: true, request_id };
  const first = await readAll(client.Generate(request, { deadline: deadline() }), (count, call) => {
    if (count === after) call.cancel();
  });
  const afterSeq = first.chunks.length ? first.chunks[first.chunks.length - 1].seq : 0;
  const rest = await readAll(client.Resume({ request_id, after_seq: afterSeq }, { deadline: deadline() }));
  return { first, after_seq: afterSeq, rest };
}

// Two ways a caller stops a long generation mid-stream: Inference/Cancel by request_id (the stream's final chunk
// says CANCELLED), and cancelling its own call when the router chose the id (nothing can resume it: it stops).
async function cancel(client, { request_id, tokens, after }) {
  const request = { prompt: "a long story", max_tokens: tokens, ignore_eos: true };
  const started = Date.now();
  let cancelled = null;
  const byId = readAll(client.Generate({ ...request, request_id }, { deadline: deadline() }), (count) => {
    if (count === after) cancelled = unary(client, "Cancel", { request_id });
  });
  const dropped = readAll(client.Generate(request, { deadline: deadline() }), (count, call) => {
    if (count === after) call.cancel();
  });
  const [stream, own] = await Promise.all([byId, dropped]);
  return { stream, cancel: await cancelled, dropped: own, elapsed_ms: Date.now() - started };
}

// Each refused call: its gRPC status name and message.
async function errors(client) {
  const generate = async (request) => (await readAll(client.Generate(request, { deadline: deadline() }))).error;
  return {
    prompt_and_messages: await generate({ prompt: "hi", messages: [{ role: "user", content: "hi" }] }),
    negative_temperature: await generate({ prompt: "hi", temperature: -1 }),
    unknown_model: await generate({ prompt: "hi", model: "no-such-model" }),
    resume_unknown: (await readAll(client.Resume({ request_id: "node-no-such-id", after_seq: 0 }))).error,
    cancel_unknown: await unary(client, "Cancel", { request_id: "node-no-such-id" }),
  };
}

const SCENARIOS = { generate, resume, cancel, errors };

async function main() {
  const [scenario, address, options = "{}"] = process.argv.slice(2);
  if (!SCENARIOS[scenario] || !address) {
    throw new Error(`usage: caller.js <${Object.keys(SCENARIOS).join("|")}> <host:port> [json options]`);
  }
  const { googleapis, ...settings } = JSON.parse(options);
  if (!googleapis) throw new Error("give the googleapis folder (google/rpc/*.proto) in the options");
  rpcTypes = loadRpcTypes(googleapis);
  const client = inferenceClient(address, googleapis);
  try {
    const result = await SCENARIOS[scenario](client, settings);
    process.stdout.write(`${JSON.stringify(result)}\n`);
  } finally {
    client.close();
  }
}

main().catch((e) => {
  process.stderr.write(`${e.stack || e}\n`);
  process.exit(1);
});
