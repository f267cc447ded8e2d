// A stateful Streamable HTTP MCP server built on the official MCP TypeScript SDK (Toolbox and
// DBHub keep no sessions over HTTP, so they cannot show the proxy losing one): an `execute_sql`
// tool on PostgreSQL (node-postgres, as DBHub uses), which logs a message to the client before
// it answers (so its answers come as event streams) and another one after (outside any call).
//
// node sdk-server.mjs NODE_MODULES_DIR PORT DSN
import { createRequire } from "node:module";
import { createServer } from "node:http";
import { randomUUID } from "node:crypto";
import { join } from "node:path";

const [modules, port, dsn] = process.argv.slice(2);
const require = createRequire(join(modules, "planarian-test.js"));
const { McpServer } = require("@modelcontextprotocol/sdk/server/mcp.js");
const { StreamableHTTPServerTransport } = require("@modelcontextprotocol/sdk/server/streamableHttp.js");
const { z } = require("zod");
const pg = require("pg");

const db = new pg.Client({ connectionString: dsn });
await db.connect();
const sessions = new Map();

function newServer() {
  const server = new McpServer({ name: "planarian-sdk-sql", version: "1" }, { capabilities: { logging: {} } });
  server.registerTool("execute_sql", { description: "Runs one SQL statement", inputSchema: { sql: z.string() } }, async ({ sql }, extra) => {
    await extra.sendNotification({ method: "notifications/message", params: { level: "info", data: `running ${sql.length} bytes` } });
    try {
      const r = await db.query(sql);
      // And one outside the call: it travels on the client's standing GET stream.
      setTimeout(() => server.server.sendLoggingMessage({ level: "info", data: "after the call" }).catch(() => {}), 100);
      return { content: [{ type: "text", text: JSON.stringify(r.rows ?? []) }] };
    } catch (e) {
      return { content: [{ type: "text", text: String(e.message) }], isError: true };
    }
  });
  // A slow tool that reports progress and notices cancellation (it then records that it was
  // cancelled, in the database, where a test can see it).
  server.registerTool("sleep", { description: "Waits", inputSchema: { ms: z.number() }, annotations: { readOnlyHint: true } }, async ({ ms }, extra) => {
    const token = extra._meta?.progressToken;
    for (let done = 0; done < ms; done += 100) {
      if (extra.signal.aborted) {
        await db.query("CREATE TABLE IF NOT EXISTS sleep_cancelled (id int)");
        return { content: [{ type: "text", text: "cancelled" }] };
      }
      if (token !== undefined) {
        await extra.sendNotification({ method: "notifications/progress", params: { progressToken: token, progress: done, total: ms } });
      }
      await new Promise((r) => setTimeout(r, 100));
    }
    return { content: [{ type: "text", text: "slept" }] };
  });
  return server;
}

createServer(async (req, res) => {
  const sid = req.headers["mcp-session-id"];
  let transport = sid && sessions.get(sid);
  if (!transport) {
    if (sid) {
      res.writeHead(404, { "Content-Type": "application/json" }).end(JSON.stringify({ jsonrpc: "2.0", id: null, error: { code: -32001, message: "Session not found" } }));
      return;
    }
    transport = new StreamableHTTPServerTransport({ sessionIdGenerator: () => randomUUID(), onsessioninitialized: (id) => sessions.set(id, transport) });
    await newServer().connect(transport);
  }
  await transport.handleRequest(req, res);
}).listen(Number(port), "127.0.0.1");
