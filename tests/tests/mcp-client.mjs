// The agent's side of `planarian mcp`, by the official MCP TypeScript SDK (a real client, not
// ours): starts `planarian mcp CONTAINER --allow fork,run` over stdio, prints the tools it lists as
// one JSON line, then calls one tool per line of stdin ({"name": …, "arguments": …}) and prints
// one JSON line per call ({"result": …} or {"error": "…"}).
//
// argv: SDK-DIR PLANARIAN CONTAINER. NODE_PATH is not honoured by ES modules: the test passes
// the SDK's directory.
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const [sdk, planarian, container] = process.argv.slice(2);
const load = (p) => import(pathToFileURL(join(sdk, "dist/esm", p)).href);
const { Client } = await load("client/index.js");
const { StdioClientTransport } = await load("client/stdio.js");

const client = new Client({ name: "planarian-agent-test", version: "1" });
const transport = new StdioClientTransport({ command: planarian, args: ["mcp", container, "--allow", "fork,run"], stderr: "inherit" });
await client.connect(transport);
const tools = await client.listTools();
console.log(JSON.stringify({ server: client.getServerVersion(), tools: tools.tools }));

for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const call = JSON.parse(line);
  try {
    const result = await client.callTool(call, undefined, { timeout: 600000 });
    console.log(JSON.stringify({ result }));
  } catch (e) {
    console.log(JSON.stringify({ error: String(e?.message ?? e) }));
  }
}
await client.close();
