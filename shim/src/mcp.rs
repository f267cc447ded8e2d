//! `planarian mcp CTR`: statepoint tools for the agent itself, as an MCP server over stdio (the
//! "stdio server" a harness adds to its agent's tools).
//!
//! Scoped to its one container: no argument names a container, a path or a host command. Each
//! result says what is now true and which statepoint was used; a failure is a tool error
//! (`isError`) with planarian's one line. Tools: `statepoint_ledger` (read-only),
//! `statepoint_save`, `statepoint_note`, `statepoint_rollback` (destructive), and, when the
//! harness allows them (`--allow fork,run`), `statepoint_fork` and `run`.

use crate::Failure;
use engine::context::Ledger;
use engine::log::Silent;
use engine::runtime::{podman, Globals};
use engine::statepoint::{self, snapshot::SnapshotRequest};
use engine::store::{Actor, ContainerStore, Outcome, OutcomeStatus};
use engine::Engine;
use planarian_contracts::jsonrpc;
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

/// The protocol versions this server speaks, newest last.
const VERSIONS: &[&str] = &["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];

pub struct Server {
    /// The container, as the user named it, and its ID.
    name: String,
    id: String,
    globals: Globals,
    allow_fork: bool,
    allow_run: bool,
}

impl Server {
    pub fn new(container: &str, allow: &[String], globals: Globals) -> Result<Server, Failure> {
        let pc = podman::planarian_container(container)?;
        let mut s = Server { name: container.to_string(), id: pc.id, globals, allow_fork: false, allow_run: false };
        for a in allow.iter().flat_map(|a| a.split(',')).filter(|a| !a.is_empty()) {
            match a {
                "fork" => s.allow_fork = true,
                "run" => s.allow_run = true,
                other => return Err(format!("--allow {other}: the optional tools are fork and run").into()),
            }
        }
        Ok(s)
    }

    /// Serves one client on stdin/stdout until it closes its end.
    pub fn serve(&self) -> Result<(), Failure> {
        self.serve_on(std::io::stdin().lock(), std::io::stdout().lock())
    }

    /// Serves one client: a message per line. Whatever a line holds (not UTF-8, not JSON, not a
    /// message, larger than [`MAX_LINE`]) gets one error answer, changes nothing, and the next
    /// line is read.
    fn serve_on(&self, mut input: impl BufRead, mut out: impl Write) -> Result<(), Failure> {
        let mut line = Vec::new();
        loop {
            line.clear();
            let (n, whole) = read_line(&mut input, &mut line, MAX_LINE)?;
            if n == 0 {
                return Ok(());
            }
            let answers: Vec<Value> = if !whole {
                vec![jsonrpc::error(
                    Value::Null,
                    jsonrpc::INVALID_REQUEST,
                    format!("a message of more than {MAX_LINE} bytes is not read"),
                )]
            } else if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            } else {
                match serde_json::from_slice::<Value>(&line) {
                    Ok(Value::Array(batch)) if batch.is_empty() => {
                        vec![jsonrpc::error(Value::Null, jsonrpc::INVALID_REQUEST, "an empty batch")]
                    }
                    Ok(Value::Array(batch)) => batch.iter().filter_map(|m| self.answer(m)).collect(),
                    Ok(m) => self.answer(&m).into_iter().collect(),
                    Err(e) => vec![jsonrpc::error(Value::Null, jsonrpc::PARSE_ERROR, format!("parse error: {e}"))],
                }
            };
            for a in answers {
                writeln!(out, "{a}")?;
                out.flush()?;
            }
        }
    }

    /// One message of any shape: a request's answer, nothing for a notification, an error for
    /// what is no message.
    fn answer(&self, msg: &Value) -> Option<Value> {
        let Some(obj) = msg.as_object() else {
            return Some(jsonrpc::error(Value::Null, jsonrpc::INVALID_REQUEST, "a message is a JSON object"));
        };
        if !obj.get("method").is_some_and(Value::is_string) {
            // An answer to nothing we asked (no method, an id): ignored, as a client's stray
            // response is; a request without a method is an error.
            let id = obj.get("id").filter(|i| !i.is_null())?;
            if obj.contains_key("result") || obj.contains_key("error") {
                return None;
            }
            return Some(jsonrpc::error(id.clone(), jsonrpc::INVALID_REQUEST, "a request names its method"));
        }
        self.handle(msg)
    }

    /// One message; the answer, for a request.
    fn handle(&self, msg: &Value) -> Option<Value> {
        let id = msg.get("id").filter(|i| !i.is_null())?.clone();
        let method = msg["method"].as_str().unwrap_or_default();
        let result = match method {
            "initialize" => {
                let asked = msg["params"]["protocolVersion"].as_str().unwrap_or_default();
                let version = VERSIONS.iter().find(|v| **v == asked).unwrap_or(VERSIONS.last().unwrap());
                Ok(json!({
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": false}},
                    "serverInfo": {"name": "planarian", "version": engine::VERSION},
                    "instructions": format!(
                        "Statepoints of the sandbox {}: save one before a risky step, note what happened after it, read the ledger to choose one, and roll back to it to undo everything done since (files, processes, memory and database changes made through MCP).",
                        self.name
                    ),
                }))
            }
            "ping" => Ok(json!({})),
            "tools/list" => Ok(json!({"tools": self.tools()})),
            "tools/call" => {
                Ok(self.call(msg["params"]["name"].as_str().unwrap_or_default(), &msg["params"]["arguments"]))
            }
            _ => Err((jsonrpc::METHOD_NOT_FOUND, format!("method not found: {method}"))),
        };
        Some(match result {
            Ok(r) => jsonrpc::result(id, r),
            Err((code, message)) => jsonrpc::error(id, code, message),
        })
    }

    /// The tools and their input schemas. (Long: a table, one entry per tool.)
    fn tools(&self) -> Vec<Value> {
        let mut tools = vec![
            tool(
                "statepoint_ledger",
                "Statepoints of this sandbox",
                "Lists the saved statepoints of this sandbox as a tree, newest first: each with its name, age, description and what was tried after it (success, failure, abandoned). The one marked * is where the sandbox is now. Read it to choose a statepoint to roll back to.",
                json!({"type": "object", "properties": {"max_chars": {"type": "integer", "minimum": 200, "description": "At most this many characters (default 4000)."}}}),
                true,
                false,
            ),
            tool(
                "statepoint_save",
                "Save a statepoint",
                "Saves the sandbox's current state (files, processes, memory, and the position of database changes made through MCP) as a new statepoint, and answers with its id. Save before a risky step so that you can return to this point.",
                json!({"type": "object", "properties": {
                    "name": {"type": "string", "description": "A short unique name, e.g. deps-installed."},
                    "description": {"type": "string", "description": "What the state is: what is done, what works."},
                    "state": {"type": "object", "description": "Structured facts to keep with it (optional)."}
                }}),
                false,
                false,
            ),
            tool(
                "statepoint_note",
                "Note what happened after a statepoint",
                "Records what happened after a statepoint (an outcome), so that you and others know what was already tried from it. The saved state itself does not change.",
                json!({"type": "object", "required": ["statepoint", "outcome", "status"], "properties": {
                    "statepoint": {"type": "string", "description": "Its id (sp3) or name."},
                    "outcome": {"type": "string", "description": "What was tried and what came of it."},
                    "status": {"type": "string", "enum": ["success", "failure", "abandoned", "info"]},
                    "reward": {"type": "number", "description": "A score, if you keep one."}
                }}),
                false,
                false,
            ),
            tool(
                "statepoint_rollback",
                "Roll the sandbox back to a statepoint",
                "Returns the whole sandbox to a statepoint: files, running processes and memory, and database changes made through MCP since then are undone. Everything done after it is lost, except that statepoints saved after it stay restorable. Answers with what is now true.",
                json!({"type": "object", "required": ["statepoint", "reason"], "properties": {
                    "statepoint": {"type": "string", "description": "Its id (sp3) or name."},
                    "reason": {"type": "string", "description": "Why: recorded with the statepoint for later attempts."}
                }}),
                false,
                true,
            ),
        ];
        if self.allow_fork {
            tools.push(tool(
                "statepoint_fork",
                "Fork a new sandbox from a statepoint",
                "Starts a second, independent sandbox from a statepoint of this one, to try an alternative; this sandbox is not changed. With count, several, made side by side (named NAME-1, NAME-2, ...), to try alternatives in parallel.",
                json!({"type": "object", "required": ["statepoint", "name"], "properties": {
                    "statepoint": {"type": "string"}, "name": {"type": "string", "description": "The new sandbox's name (with count: the stem of their names)."},
                    "count": {"type": "integer", "minimum": 1, "maximum": 16, "description": "How many forks (default 1)."}
                }}),
                false,
                false,
            ));
        }
        if self.allow_run {
            tools.push(tool(
                "run",
                "Run a shell command in the sandbox",
                "Runs a command with sh -c in the sandbox and answers with its output and exit code.",
                json!({"type": "object", "required": ["command"], "properties": {
                    "command": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1, "description": "Seconds (default 300)."}
                }}),
                false,
                true,
            ));
        }
        tools
    }

    /// A tool call: its text, or a tool error with one line.
    fn call(&self, name: &str, args: &Value) -> Value {
        let r = match name {
            "statepoint_ledger" => self.ledger(args),
            "statepoint_save" => self.save(args),
            "statepoint_note" => self.note(args),
            "statepoint_rollback" => self.rollback(args),
            "statepoint_fork" if self.allow_fork => self.fork(args),
            "run" if self.allow_run => self.run(args),
            other => Err(format!("unknown tool {other}").into()),
        };
        match r {
            Ok(text) => json!({"content": [{"type": "text", "text": text}], "isError": false}),
            Err(e) => json!({"content": [{"type": "text", "text": format!("planarian: {e}")}], "isError": true}),
        }
    }

    /// The engine of one tool call: the configuration as it is now (the server runs as long as
    /// the agent's session; a change an operator made in between applies to the next call).
    fn engine(&self) -> Result<Engine, Failure> {
        Ok(Engine::load(self.globals.clone())?)
    }

    fn store(&self) -> Result<ContainerStore, Failure> {
        Ok(self.engine()?.store(&self.id))
    }

    fn ledger(&self, args: &Value) -> Result<String, Failure> {
        let max = args["max_chars"].as_u64().map_or(4000, |m| m.max(200) as usize);
        Ok(Ledger::of(&self.store()?, &self.name).text(Some(max)))
    }

    /// An asynchronous snapshot: answers once the worker holds the lock, with the id; the next
    /// tool call (the harness's shell, this server's run, an MCP write) waits for it.
    fn save(&self, args: &Value) -> Result<String, Failure> {
        let req = SnapshotRequest {
            leave_running: true,
            name: str_arg(args, "name"),
            description: str_arg(args, "description"),
            state: args.get("state").filter(|s| s.is_object()).cloned(),
            ..Default::default()
        };
        let id = self.engine()?.snapshot_async(&self.id, &req, &std::env::current_exe()?)?;
        Ok(format!(
            "Saving statepoint {id}{} of {} in the background; your next command runs once it is saved. You can roll back to it with statepoint_rollback.",
            req.name.as_ref().map(|n| format!(" \"{n}\"")).unwrap_or_default(),
            self.name
        ))
    }

    fn note(&self, args: &Value) -> Result<String, Failure> {
        let sp = required(args, "statepoint")?;
        let text = required(args, "outcome")?;
        let status = match args["status"].as_str() {
            Some("success") => OutcomeStatus::Success,
            Some("failure") => OutcomeStatus::Failure,
            Some("abandoned") => OutcomeStatus::Abandoned,
            Some("info") => OutcomeStatus::Info,
            _ => return Err("status must be one of success, failure, abandoned, info".into()),
        };
        let outcome = Outcome::now(text, status, Actor::Agent, args["reward"].as_f64());
        let m = statepoint::annotate(&self.store()?, &sp, None, None, vec![outcome])?;
        Ok(format!(
            "Noted on statepoint {}: {} ({} outcomes recorded there).",
            m.statepoint_id,
            args["status"].as_str().unwrap_or(""),
            m.state_evidence.prior_outcomes.len()
        ))
    }

    fn rollback(&self, args: &Value) -> Result<String, Failure> {
        let sp = required(args, "statepoint")?;
        let reason = required(args, "reason")?;
        let r = self.engine()?.rollback(&self.id, &sp, false)?;
        let ctx = r.run(&mut Silent, Some(&reason), Actor::Agent)?;
        Ok(ctx.text())
    }

    fn fork(&self, args: &Value) -> Result<String, Failure> {
        let sp = required(args, "statepoint")?;
        let name = required(args, "name")?;
        let count = match args.get("count") {
            None | Some(Value::Null) => None,
            Some(v) => {
                Some(v.as_u64().filter(|n| (1..=16).contains(n)).ok_or("count must be a whole number from 1 to 16")?)
            }
        };
        let Some(count) = count else {
            let f = self.engine()?.fork(&self.id, &sp, Some(&name))?;
            let (_, ctx) = f.run(&mut Silent, Actor::Agent)?;
            return Ok(format!("{}The sandbox {} continues unchanged; the fork is {name}.", ctx.text(), self.name));
        };
        let names: Vec<Option<String>> = (1..=count).map(|k| Some(format!("{name}-{k}"))).collect();
        let f = self.engine()?.fork(&self.id, &sp, None)?;
        let sp = statepoint::describe(&f.target);
        let silent = |_: &str| -> Box<dyn engine::log::Progress + Send> { Box::new(Silent) };
        let mut made = Vec::new();
        let mut failed = Vec::new();
        for (n, r) in f.run_many(&names, &silent, Actor::Agent)? {
            match r {
                Ok(_) => made.push(n),
                Err(e) => failed.push(format!("{n}: {e}")),
            }
        }
        let mut text = format!(
            "{} of {count} forks of statepoint {sp} run: {}. Each starts from the statepoint; the sandbox {} continues unchanged.",
            made.len(),
            if made.is_empty() { "none".to_string() } else { made.join(", ") },
            self.name
        );
        if !failed.is_empty() {
            text.push_str(&format!(" Failed (nothing left of them): {}.", failed.join("; ")));
        }
        match made.is_empty() {
            true => Err(text.into()),
            false => Ok(text),
        }
    }

    fn run(&self, args: &Value) -> Result<String, Failure> {
        let command = required(args, "command")?;
        let timeout = Duration::from_secs(args["timeout"].as_u64().unwrap_or(300).max(1));
        // Through Podman and planarian's exec: the container's shared lock, like any tool call.
        let podman = podman::podman()?;
        let mut child = std::process::Command::new(podman)
            .args(["exec", &self.id, "sh", "-c", &command])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let end = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                let out = child.wait_with_output()?;
                let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
                text += &String::from_utf8_lossy(&out.stderr);
                return Ok(format!(
                    "{text}{}[exit code {}]",
                    if text.is_empty() || text.ends_with('\n') { "" } else { "\n" },
                    status.code().unwrap_or(-1)
                ));
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the command did not finish within {} s and was stopped", timeout.as_secs()).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn tool(name: &str, title: &str, description: &str, schema: Value, read_only: bool, destructive: bool) -> Value {
    json!({
        "name": name,
        "title": title,
        "description": description,
        "inputSchema": schema,
        "annotations": {"title": title, "readOnlyHint": read_only, "destructiveHint": destructive, "idempotentHint": read_only, "openWorldHint": false},
    })
}

fn str_arg(args: &Value, key: &str) -> Option<String> {
    args[key].as_str().filter(|s| !s.is_empty()).map(String::from)
}

/// The longest message read (a tool call's arguments are small; a client that sends more is
/// answered with an error, and its line skipped, not held in memory).
const MAX_LINE: usize = 4 << 20;

/// Reads one line (without its newline) into `buf`, at most `max` bytes of it; the bytes read
/// (0 at the end of the input) and whether the line was whole (a longer one is read to its end
/// and dropped).
fn read_line(input: &mut impl BufRead, buf: &mut Vec<u8>, max: usize) -> std::io::Result<(usize, bool)> {
    let mut total = 0;
    let mut whole = true;
    loop {
        let chunk = input.fill_buf()?;
        if chunk.is_empty() {
            return Ok((total, whole));
        }
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let body = &chunk[..if done { take - 1 } else { take }];
        if whole && buf.len() + body.len() <= max {
            buf.extend_from_slice(body);
        } else {
            whole = false;
            buf.clear();
        }
        total += take;
        input.consume(take);
        if done {
            return Ok((total, whole));
        }
    }
}

fn required(args: &Value, key: &str) -> Result<String, Failure> {
    str_arg(args, key).ok_or_else(|| format!("{key} is required").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(allow: (bool, bool)) -> Server {
        Server {
            name: "agent".into(),
            id: "0".repeat(64),
            globals: Globals::default(),
            allow_fork: allow.0,
            allow_run: allow.1,
        }
    }

    #[test]
    fn speaks_the_protocol_and_lists_annotated_tools() {
        let s = server((false, false));
        let init = s.handle(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}})).unwrap();
        assert_eq!(init["result"]["protocolVersion"], "2025-06-18");
        let old = s.handle(&json!({"jsonrpc": "2.0", "id": 2, "method": "initialize", "params": {"protocolVersion": "1999-01-01"}})).unwrap();
        assert_eq!(old["result"]["protocolVersion"], *VERSIONS.last().unwrap());
        assert!(s.handle(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).is_none());
        let list = s.handle(&json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list"})).unwrap();
        let tools = list["result"]["tools"].as_array().unwrap();
        let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["statepoint_ledger", "statepoint_save", "statepoint_note", "statepoint_rollback"]);
        assert_eq!(tools[0]["annotations"]["readOnlyHint"], true);
        assert_eq!(tools[3]["annotations"]["destructiveHint"], true);
        let all = server((true, true)).tools();
        assert_eq!(all.len(), 6);
        assert_eq!(s.handle(&json!({"jsonrpc": "2.0", "id": 4, "method": "nope"})).unwrap()["error"]["code"], -32601);
    }

    /// Hostile traffic: each line gets one error (or nothing, for a stray response) and the
    /// server reads on.
    #[test]
    fn malformed_traffic_gets_one_error_a_line_and_the_server_reads_on() {
        let s = server((false, false));
        let mut input = Vec::new();
        input.extend_from_slice(b"\xff\xfe not utf-8\n");
        input.extend_from_slice(b"{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \n");
        input.extend_from_slice(&vec![b'x'; MAX_LINE + 10]);
        input.extend_from_slice(b"\n[]\n5\n\"text\"\n");
        input.extend_from_slice(b"{\"jsonrpc\": \"2.0\", \"id\": 7}\n");
        input.extend_from_slice(b"{\"jsonrpc\": \"2.0\", \"id\": 8, \"result\": {}}\n");
        input.extend_from_slice(b"[1, {\"jsonrpc\": \"2.0\", \"id\": 9, \"method\": \"ping\"}]\n");
        input.extend_from_slice(b"{\"jsonrpc\": \"2.0\", \"id\": 10, \"method\": \"tools/call\", \"params\": 3}\n");
        input.extend_from_slice(b"\n  \n{\"jsonrpc\": \"2.0\", \"id\": 11, \"method\": \"ping\"}");
        let mut out = Vec::new();
        s.serve_on(&input[..], &mut out).unwrap();
        let answers: Vec<Value> =
            String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let codes: Vec<(Value, i64)> =
            answers.iter().map(|a| (a["id"].clone(), a["error"]["code"].as_i64().unwrap_or(0))).collect();
        assert_eq!(
            codes,
            vec![
                (Value::Null, -32700),
                (Value::Null, -32700),
                (Value::Null, -32600),
                (Value::Null, -32600),
                (Value::Null, -32600),
                (Value::Null, -32600),
                (json!(7), -32600),
                (Value::Null, -32600),
                (json!(9), 0),
                (json!(10), 0),
                (json!(11), 0),
            ],
            "{answers:#?}"
        );
        assert_eq!(answers[9]["result"]["isError"], true, "a call without arguments is a tool error");
        assert!(answers[2]["error"]["message"].as_str().unwrap().contains("more than"));
    }

    #[test]
    fn bad_arguments_and_tools_not_allowed_are_tool_errors_with_one_line() {
        let s = server((false, false));
        let r = s.call("statepoint_rollback", &json!({"statepoint": "sp1"}));
        assert_eq!(r["isError"], true);
        assert_eq!(r["content"][0]["text"], "planarian: reason is required");
        let r = s.call("run", &json!({"command": "rm -rf /"}));
        assert_eq!(
            (r["isError"].as_bool(), r["content"][0]["text"].as_str()),
            (Some(true), Some("planarian: unknown tool run"))
        );
        let r = s.call("statepoint_note", &json!({"statepoint": "sp1", "outcome": "x", "status": "great"}));
        assert!(r["content"][0]["text"].as_str().unwrap().contains("status must be"), "{r}");
    }
}
