// A harness's side of Streamable HTTP, by the official MCP TypeScript SDK (a real client, not
// ours): connects to the URL in argv[2], lists the tools, then calls the SQL tool once per line
// of stdin and prints one JSON line per call ({"result": …} or {"error": "…"}).
//
// NODE_PATH is not honoured by ES modules: the test passes the SDK's directory as argv[3].
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const [url, sdk] = process.argv.slice(2);
const load = (p) => import(pathToFileURL(join(sdk, "dist/esm", p)).href);
const { Client } = await load("client/index.js");
const { StreamableHTTPClientTransport } = await load("client/streamableHttp.js");

const client = new Client({ name: "planarian-sdk-test", version: "1" });
const transport = new StreamableHTTPClientTransport(new URL(url));
await client.connect(transport);
const tools = await client.listTools();
console.log(JSON.stringify({ tools: tools.tools.map((t) => t.name), session: transport.sessionId ?? null }));

for await (const sql of createInterface({ input: process.stdin })) {
  if (!sql.trim()) continue;
  try {
    const result = await client.callTool({ name: "execute_sql", arguments: { sql } });
    console.log(JSON.stringify({ result }));
  } catch (e) {
    console.log(JSON.stringify({ error: String(e?.message ?? e) }));
  }
}
await transport.terminateSession().catch(() => {});
await client.close();
