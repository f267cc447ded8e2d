//! The transparent MCP proxy: to the harness over stdio, a Unix socket or Streamable HTTP
//! (httpd.rs); to the real server over stdio or Streamable HTTP.
//!
//! Messages are raw JSON values: whatever the proxy does not need to understand passes through
//! unchanged. Every client request gets a fresh upstream id (the proxy's own requests come from
//! the same counter, so they can never collide); responses are mapped back, and
//! `notifications/cancelled` is remapped. Every `tools/call` goes through the tool policy
//! ([`tool_calls`]): reads pass through at once; SQL (the SQL tool, Toolbox's own SQL tools) is
//! classified, and writes are numbered (the MCP call position), rewritten to record their undo
//! rows, and run one at a time under the proxy lock; declared tools are numbered and journaled
//! with their compensation; what cannot be undone is refused with a tool error before it
//! reaches the server. A disabled proxy (a fork without a copy of the service) starts no
//! upstream at all: it answers the harness itself and refuses every call, saying why.

//!
//! This module routes messages and remaps ids; [`upstream`] is the way to the real server (a
//! child over stdio, or Streamable HTTP with messages sent in order), [`sql_calls`] the
//! interception of SQL, [`tool_calls`] the policy and the declared tools.

mod sql_calls;
mod tool_calls;
mod upstream;

use crate::db::Db;
use crate::error::{Error, Result};
use crate::http;
use crate::journal::Journal;
use crate::state::Positions;
use planarian_contracts::{control, jsonrpc, Uncovered};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use upstream::Upstream;

/// How the server's SQL tool takes statements and reports results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// MCP Toolbox: one statement per call (a prepared statement); one text item per row.
    Toolbox,
    /// DBHub: several statements in one transaction; a JSON report echoing each statement.
    Dbhub,
}

pub struct Options {
    /// The real server, spawned over stdio …
    pub upstream: Vec<String>,
    /// … or reached over Streamable HTTP.
    pub upstream_url: Option<http::Url>,
    pub server: Server,
    pub sql_tool: String,
    pub sql_arg: String,
    /// Refuse every call with this reason and start no upstream (a fork: the service has no
    /// copy of its own for it).
    pub disabled: Option<String>,
    /// The database SQL tools write to, where their undo rows are kept (none: no SQL tool).
    pub dsn: Option<String>,
    /// Declared compensations, reads, refusals and passes.
    pub specs: Vec<crate::spec::Spec>,
    /// Tools let through unrecorded (`*`: every tool nothing else classified).
    pub pass: Vec<String>,
    /// MCP Toolbox's configuration, when the upstream is Toolbox with tools of its own.
    pub toolbox: Option<crate::toolbox::Config>,
    /// The database to use instead of the one `dsn` names (a fork's branch); it also replaces
    /// `{dbname}` in the upstream command, its environment and its URL.
    pub dbname: Option<String>,
    pub state_file: std::path::PathBuf,
    /// The container's lock file: a mutating call holds it shared, as every tool call does, so
    /// that it waits while a snapshot or a rollback of the sandbox holds it exclusively.
    pub sandbox_lock: Option<std::path::PathBuf>,
}

impl Options {
    /// The proxy's own connection: `dsn`, with `dbname` when set.
    pub fn pg_config(&self) -> Result<postgres::Config> {
        let dsn =
            self.dsn.as_deref().ok_or_else(|| Error::Refused("this proxy has no database (--database)".into()))?;
        let mut c: postgres::Config = dsn.parse().map_err(|e| Error::Refused(format!("--database {dsn}: {e}")))?;
        if let Some(d) = &self.dbname {
            c.dbname(d);
        }
        Ok(c)
    }

    /// The database's name as the upstream server must be told it (`{dbname}`): libpq's
    /// default is the user's name.
    pub fn effective_dbname(&self) -> Result<String> {
        if self.dsn.is_none() {
            return Ok(String::new());
        }
        let c = self.pg_config()?;
        Ok(c.get_dbname().or(c.get_user()).unwrap_or("postgres").to_string())
    }
}

/// The name of the branch of database `current` for the fork `container`.
fn branch_name(current: &str, container: &str) -> String {
    let suffix: String = container.chars().filter(|c| c.is_ascii_alphanumeric()).take(12).collect();
    let prefix: String = current.chars().take(63 - 1 - suffix.len()).collect();
    format!("{prefix}_{suffix}")
}

/// The largest database a fork gets a copy of.
pub const BRANCH_MAX_BYTES: i64 = 1 << 30;

/// Where messages for a client go: a stream (stdio, a connection to the listening socket), or
/// one HTTP exchange of a Streamable HTTP session.
pub struct Conn {
    out: Out,
    /// Which client this is: the requests a `notifications/cancelled` may name are its own,
    /// and the exchanges of one HTTP session are one client.
    client: String,
}

enum Out {
    Stream(Mutex<Box<dyn Write + Send>>),
    Channel(Mutex<Sender<Value>>),
}

impl Conn {
    pub fn new(out: Box<dyn Write + Send>) -> Arc<Conn> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(Conn {
            out: Out::Stream(Mutex::new(out)),
            client: format!("stream-{}", NEXT.fetch_add(1, Ordering::Relaxed)),
        })
    }

    /// A connection whose messages are received from the channel (by an HTTP exchange).
    pub fn channel(client: String) -> (Arc<Conn>, Receiver<Value>) {
        let (tx, rx) = channel();
        (Arc::new(Conn { out: Out::Channel(Mutex::new(tx)), client }), rx)
    }

    /// One message, one write: the line is built first (serializing straight into a socket
    /// costs a system call per token). False when the client is gone.
    fn send(&self, msg: &Value) -> bool {
        match &self.out {
            Out::Stream(out) => {
                let Ok(mut line) = serde_json::to_vec(msg) else { return false };
                line.push(b'\n');
                let mut out = out.lock().unwrap();
                out.write_all(&line).and_then(|_| out.flush()).is_ok()
            }
            Out::Channel(tx) => tx.lock().unwrap().send(msg.clone()).is_ok(),
        }
    }
}

/// How a rewritten SQL call reaches the database: through the tool that was called (its SQL
/// argument replaced), or through the hidden execute tool of a Toolbox source.
pub(super) enum Via {
    Own,
    Hidden(String),
}

enum Pending {
    /// A client's request: its own id, its connection, and whether it is a `tools/list` (whose
    /// answer loses the hidden tools).
    Client(Value, Arc<Conn>, bool),
    Own(Sender<Value>),
}

pub struct Proxy {
    opts: Options,
    /// Where the server's own requests and notifications go: the client heard from last …
    last_client: Mutex<Option<Arc<Conn>>>,
    /// … or, when that exchange is over, the latest standing HTTP event stream (GET).
    standing: Mutex<Option<Arc<Conn>>>,
    upstream: Mutex<Option<Upstream>>,
    /// Set while the upstream is being (re)started.
    generation: (Mutex<u64>, Condvar),
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    /// The proxy lock: held by a mutating call from before its position is taken until its
    /// response arrives, and by captures and compensations.
    lock: Mutex<()>,
    positions: Mutex<Positions>,
    db: Option<Mutex<Db>>,
    journal: Mutex<Journal>,
    /// The server's tools and their annotations, once asked.
    tools: Mutex<Option<HashMap<String, Value>>>,
    disabled: Mutex<Option<String>>,
    initialize: Mutex<Option<Value>>,
    closing: AtomicBool,
}

impl Proxy {
    /// The sandbox's lock, shared, for the length of a mutating call (taken before the proxy
    /// lock: a snapshot holds the sandbox's lock while it asks for the position under the proxy
    /// lock). `Err` with one line when the lock file cannot be used.
    fn sandbox_lock(&self) -> Result<Option<std::fs::File>> {
        let Some(path) = &self.opts.sandbox_lock else { return Ok(None) };
        let f = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| Error::Refused(format!("cannot open the sandbox's lock {}: {e}", path.display())))?;
        f.lock_shared().map_err(|e| Error::Refused(format!("cannot lock {}: {e}", path.display())))?;
        // A rollback whose planarian was killed after it restored the sandbox and before its
        // compensation ended leaves its intent: a call now would be undone by the compensation
        // that finishes it.
        if path.with_file_name("compensating.json").exists() {
            return Err(Error::Refused("a rollback of this sandbox was interrupted before its remote state was put back; the next planarian operation on it (a snapshot, a rollback) finishes it".into()));
        }
        Ok(Some(f))
    }

    pub fn new(opts: Options) -> Result<Arc<Proxy>> {
        // A disabled proxy reaches nothing of the source: no database, no upstream.
        let mut db = match (&opts.dsn, &opts.disabled) {
            (Some(_), None) => Some(Db::connect(&opts.pg_config()?)?),
            _ => None,
        };
        let journal = Journal::load(&Journal::path_for(&opts.state_file))?;
        let floor = db.as_mut().map(|d| d.max_position()).transpose()?.unwrap_or(0).max(journal.max_position());
        let positions = Positions::load(&opts.state_file, floor)?;
        let p = Arc::new(Proxy {
            last_client: Mutex::new(None),
            standing: Mutex::new(None),
            upstream: Mutex::new(None),
            generation: (Mutex::new(0), Condvar::new()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            lock: Mutex::new(()),
            positions: Mutex::new(positions),
            db: db.map(Mutex::new),
            journal: Mutex::new(journal),
            tools: Mutex::new(None),
            disabled: Mutex::new(opts.disabled.clone()),
            initialize: Mutex::new(None),
            closing: AtomicBool::new(false),
            opts,
        });
        if p.opts.disabled.is_none() {
            p.start_upstream()?;
        }
        Ok(p)
    }

    fn send_client(&self, msg: &Value) {
        let conn = self.last_client.lock().unwrap().clone();
        if conn.is_some_and(|c| c.send(msg)) {
            return;
        }
        let standing = self.standing.lock().unwrap().clone();
        if let Some(c) = standing {
            c.send(msg);
        }
    }

    /// An HTTP client's standing event stream (GET): the server's messages outside any call.
    pub fn set_standing(&self, conn: Arc<Conn>) {
        *self.standing.lock().unwrap() = Some(conn);
    }

    fn reply(conn: &Conn, id: &Value, result: Value) {
        conn.send(&jsonrpc::result(id.clone(), result));
    }

    /// A call refused before it reached the server: a tool error of one line.
    fn refuse(conn: &Conn, id: &Value, why: &str) {
        Self::reply(
            conn,
            id,
            json!({"content": [{"type": "text", "text": format!("planarian: not executed: {why}")}], "isError": true}),
        );
    }

    fn reply_error(conn: &Conn, id: &Value, code: i64, message: &str) {
        conn.send(&jsonrpc::error(id.clone(), code, message));
    }

    /// The proxy's own database connection: only SQL paths use it, and the policy sends calls
    /// down them only when there is one.
    fn db(&self) -> std::sync::MutexGuard<'_, Db> {
        self.db.as_ref().expect("an SQL call on a proxy without a database").lock().unwrap()
    }

    /// Forwards a client request under a fresh upstream id.
    fn forward_request(self: &Arc<Self>, mut msg: Value, conn: &Arc<Conn>) {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let list = msg["method"] == json!("tools/list");
        let orig = std::mem::replace(&mut msg["id"], json!(id));
        self.pending.lock().unwrap().insert(id, Pending::Client(orig.clone(), conn.clone(), list));
        if let Err(e) = self.send_upstream(&msg) {
            self.pending.lock().unwrap().remove(&id);
            Self::reply_error(conn, &orig, jsonrpc::INTERNAL_ERROR, &e.to_string());
        }
    }

    /// Sends a request of the proxy's own (or a rewritten client call) and waits for its response.
    fn call_upstream(self: &Arc<Self>, method: &str, params: Value) -> Result<Value> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = channel();
        self.pending.lock().unwrap().insert(id, Pending::Own(tx));
        if let Err(e) = self.send_upstream(&jsonrpc::request(id, method, params)) {
            self.pending.lock().unwrap().remove(&id);
            return Err(e);
        }
        rx.recv().map_err(|_| Error::Upstream("the upstream MCP server exited before answering".into()))
    }

    fn on_upstream_message(&self, mut msg: Value) {
        let is_response = msg.get("method").is_none() && msg.get("id").is_some();
        if !is_response {
            if msg["method"] == json!("notifications/tools/list_changed") {
                self.forget_tools();
            }
            // Server-to-client requests and notifications pass through unchanged.
            return self.send_client(&msg);
        }
        let Some(id) = msg["id"].as_u64() else { return };
        match self.pending.lock().unwrap().remove(&id) {
            Some(Pending::Client(orig, conn, list)) => {
                msg["id"] = orig;
                // (`get_mut`: indexing a Value mutably would add the keys it looks for)
                if let Some(tools) = msg
                    .get_mut("result")
                    .and_then(|r| r.get_mut("tools"))
                    .and_then(Value::as_array_mut)
                    .filter(|_| list)
                {
                    tools.retain(|t| !t["name"].as_str().is_some_and(crate::toolbox::is_hidden));
                }
                conn.send(&msg);
            }
            Some(Pending::Own(tx)) => {
                let _ = tx.send(msg);
            }
            None => {}
        }
    }

    /// Serves one client stream until it ends.
    pub fn serve(self: &Arc<Self>, input: impl BufRead, conn: Arc<Conn>) {
        for line in input.lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Value>(&line) {
                Ok(Value::Array(batch)) => batch.into_iter().for_each(|m| self.handle(m, &conn)),
                Ok(m) => self.handle(m, &conn),
                Err(e) => Self::reply_error(&conn, &Value::Null, jsonrpc::PARSE_ERROR, &format!("parse error: {e}")),
            }
        }
    }

    /// One message from a client.
    pub fn handle(self: &Arc<Self>, msg: Value, conn: &Arc<Conn>) {
        if msg.get("method").is_some() && msg.get("id").is_some_and(|i| !i.is_null()) {
            *self.last_client.lock().unwrap() = Some(conn.clone());
        }
        self.from_client(msg, conn);
    }

    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let up = self.upstream.lock().unwrap().take();
        if let Some(Upstream::Http(h)) = &up {
            Self::end_session(h);
        }
        if let Some(Upstream::Stdio(mut child, stdin)) = up {
            drop(stdin);
            let end = std::time::Instant::now() + std::time::Duration::from_secs(3);
            while std::time::Instant::now() < end {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn from_client(self: &Arc<Self>, mut msg: Value, conn: &Arc<Conn>) {
        // Only objects are messages (a batch is split once): anything else would pass unseen.
        if !msg.is_object() {
            return Self::reply_error(
                conn,
                &Value::Null,
                -32600,
                "invalid request: not a JSON-RPC message (a batch inside a batch?)",
            );
        }
        let method = msg.get("method").and_then(Value::as_str).map(String::from);
        let has_id = msg.get("id").is_some_and(|v| !v.is_null());
        // A tool call without an id has no answer to carry a refusal: it is never forwarded.
        if method.as_deref() == Some("tools/call") && !has_id {
            eprintln!("planarian-mcp-proxy: dropped a tools/call without an id (a JSON-RPC request needs one)");
            return;
        }
        if self.opts.disabled.is_some() {
            return self.answer_disabled(method.as_deref(), has_id, &msg, conn);
        }
        match (method.as_deref(), has_id) {
            (Some("initialize"), true) => {
                *self.initialize.lock().unwrap() = Some(msg["params"].clone());
                self.forward_request(msg, conn);
            }
            (Some("tools/call"), true) => {
                // A read of the SQL tool that calls no function needs nothing of the database:
                // straight on.
                if msg["params"]["name"].as_str() == Some(&self.opts.sql_tool)
                    && self.db.is_some()
                    && self.plain_read(&msg)
                {
                    return self.forward_request(msg, conn);
                }
                self.tool_call(msg, conn);
            }
            (Some(_), true) => self.forward_request(msg, conn),
            (Some("notifications/cancelled"), false) => {
                let orig = msg["params"]["requestId"].clone();
                let up = self.pending.lock().unwrap().iter().find_map(|(k, p)| {
                    matches!(p, Pending::Client(o, c, _) if *o == orig && c.client == conn.client).then_some(*k)
                });
                if let Some(up) = up {
                    msg["params"]["requestId"] = json!(up);
                    let _ = self.send_upstream(&msg);
                }
            }
            // Other notifications, and responses to the server's own requests: unchanged.
            _ => {
                let _ = self.send_upstream(&msg);
            }
        }
    }

    /// A disabled proxy has no upstream: it answers the harness itself, lists no tools and
    /// refuses every call with the reason.
    fn answer_disabled(&self, method: Option<&str>, has_id: bool, msg: &Value, conn: &Arc<Conn>) {
        if !has_id {
            return;
        }
        let why = self.disabled.lock().unwrap().clone().unwrap_or_default();
        let id = &msg["id"];
        match method {
            Some("initialize") => {
                let version = msg["params"]["protocolVersion"].as_str().unwrap_or("2025-06-18");
                Self::reply(
                    conn,
                    id,
                    json!({"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": {"name": "planarian-mcp-proxy", "version": env!("CARGO_PKG_VERSION")}, "instructions": format!("Every tool of this service is refused here: {why}")}),
                );
            }
            Some("ping") => Self::reply(conn, id, json!({})),
            Some("tools/list") => Self::reply(conn, id, json!({"tools": []})),
            Some("tools/call") => Self::refuse(conn, id, &why),
            _ => {
                Self::reply_error(conn, id, jsonrpc::METHOD_NOT_FOUND, &format!("not available in this sandbox: {why}"))
            }
        }
    }

    // --- the control interface -------------------------------------------------------------

    /// The current position, taken under the proxy lock (no write is in flight).
    pub fn capture(&self) -> Result<u64> {
        let _guard = self.lock.lock().unwrap();
        self.positions.lock().unwrap().captured()
    }

    /// The calls after position `from` up to `to` that changed something, and the tables.
    pub fn changes(&self, from: u64, to: u64) -> Result<(u64, Vec<String>)> {
        let (mut calls, mut tables) = match &self.db {
            Some(db) => db.lock().unwrap().changes_between(from, to)?,
            None => (0, vec![]),
        };
        let (n, tools) = self.journal.lock().unwrap().between(from, to);
        calls += n;
        tables.extend(tools);
        Ok((calls, tables))
    }

    /// The tools passed unrecorded, and the first position after which one was: no statepoint
    /// captured since covers this service.
    pub fn uncovered(&self) -> Option<Uncovered> {
        let pos = self.positions.lock().unwrap();
        let since = pos.passed.iter().map(|(f, _, _)| *f).min()?;
        let last = pos.passed.iter().map(|(_, l, _)| *l).max()?;
        let mut tools: Vec<String> = pos.passed.iter().map(|(_, _, t)| t.clone()).collect();
        tools.sort();
        Some(Uncovered { since, last, tools })
    }

    /// Undoes every call after `to`, newest first: declared tools through their undo calls,
    /// SQL through its undo rows (one transaction for each run of SQL calls). When a step fails
    /// it stops there; what was undone before stays undone, and the position says so.
    pub fn compensate(self: &Arc<Self>, to: u64) -> Result<u64> {
        let _guard = self.lock.lock().unwrap();
        // (the positions are not held across the server's calls: a pass on a client's reader
        // takes them; the proxy lock keeps every other change out)
        let current = {
            let pos = self.positions.lock().unwrap();
            pos.check_reachable(to)?;
            pos.current
        };
        let sql = |down_to: u64| -> Result<u64> {
            match &self.db {
                Some(db) => db.lock().unwrap().compensate_to(down_to),
                None => Ok(0),
            }
        };
        let entries = self.journal.lock().unwrap().after(to);
        let mut undone = 0;
        // Where the remote state is: every call after `reached` is undone.
        let mut reached = current;
        let mut run = || -> Result<()> {
            for e in &entries {
                undone += sql(e.position)?;
                reached = reached.min(e.position);
                self.undo_entry(e)?;
                reached = e.position - 1;
                undone += 1;
                self.journal.lock().unwrap().undone(e.position)?;
            }
            undone += sql(to)?;
            reached = to;
            Ok(())
        };
        let result = run();
        // Written down however it ended: a statepoint after `reached` can no longer be reached.
        let noted = self.positions.lock().unwrap().compensated(reached);
        match (result, noted) {
            (Ok(()), Ok(())) => {
                if let Err(e) = self.journal.lock().unwrap().compact() {
                    eprintln!("planarian-mcp-proxy: {e}");
                }
                Ok(undone)
            }
            (Err(err), _) | (Ok(()), Err(err)) if reached < current => Err(Error::Refused(format!(
                "partly undone: the calls after position {reached} were undone, then: {}",
                err.to_string().replace('\n', " ")
            ))),
            (Err(err), _) | (Ok(()), Err(err)) => Err(err),
        }
    }

    /// Branches the database for the fork `container` at `position`: a copy of it as it is now,
    /// compensated on the copy back to `position` (the source is never changed). Returns the
    /// copy's name. Refused when the position can no longer be reached here, when the database
    /// is larger than BRANCH_MAX_BYTES (a logical copy takes time in proportion), or when this
    /// proxy's role cannot create databases.
    pub fn branch(&self, position: u64, container: &str) -> Result<String> {
        self.positions.lock().unwrap().check_reachable(position)?;
        if self.db.is_none() {
            return Err(Error::Refused("this service has no database to copy for a fork".into()));
        }
        if self.journal.lock().unwrap().max_position() > 0 || self.opts.specs.iter().any(|s| !s.tools.is_empty()) {
            return Err(Error::Refused(
                "this service's tools change state that cannot be copied for a fork: the fork's calls are refused"
                    .into(),
            ));
        }
        let (current, size, major) = self.db().describe()?;
        if size > BRANCH_MAX_BYTES {
            return Err(Error::Refused(format!(
                "the database {current} holds {} MiB; a fork gets its own copy only up to {} MiB (a logical copy)",
                size >> 20,
                BRANCH_MAX_BYTES >> 20
            )));
        }
        let name = branch_name(&current, container);
        self.db().create_database(&name)?;
        let from = self.opts.pg_config()?;
        let mut to = from.clone();
        to.dbname(&name);
        let made = (|| {
            crate::db::copy_database(&from, &to, major)?;
            let mut copy = Db::connect(&to)?;
            copy.compensate_to(position)?;
            copy.mark_branch(position)
        })();
        if let Err(e) = made {
            let _ = self.db().drop_database(&name);
            return Err(Error::Refused(format!("cannot branch the database {current}: {e}")));
        }
        Ok(name)
    }

    /// Drops the branch made for the fork `container` (a fork that failed after it was made);
    /// returns its name. Nothing when there is none.
    pub fn unbranch(&self, container: &str) -> Result<String> {
        if self.db.is_none() {
            return Ok(String::new());
        }
        let mut db = self.db();
        let (current, _, _) = db.describe()?;
        let name = branch_name(&current, container);
        db.drop_database(&name)?;
        Ok(name)
    }

    pub fn disable(&self, why: String) {
        *self.disabled.lock().unwrap() = Some(why);
    }

    pub fn status(&self) -> control::Status {
        let uncovered = self.uncovered();
        let pos = self.positions.lock().unwrap();
        let (upstream_pid, upstream_url) = match self.upstream.lock().unwrap().as_ref() {
            Some(Upstream::Stdio(c, _)) => (Some(c.id()), None),
            Some(Upstream::Http(h)) => (None, Some(h.url.clone())),
            None => (None, None),
        };
        control::Status {
            position: pos.current,
            last: pos.last,
            compensations: pos.events.len(),
            disabled: self.disabled.lock().unwrap().clone(),
            uncovered,
            specs: self.opts.specs.iter().map(|s| s.server.clone()).collect(),
            upstream_pid,
            upstream_url,
        }
    }
}
