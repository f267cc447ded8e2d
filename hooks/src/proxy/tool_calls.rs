//! The tool policy: every `tools/call` is a read (passes), compensable (numbered and recorded
//! with its compensation), passed unrecorded by the user's explicit choice (and then every
//! statepoint says it does not cover this service), or refused before it reaches the server.
//!
//! In order: what the proxy understands itself (the SQL tool, Toolbox's own SQL tools), then the
//! specs (declared compensations, reads, refusals, passes), then `--pass`, then the server's
//! annotations for reads (`readOnlyHint`; the proxy trusts the upstream it was configured
//! with). A tool nobody classified is refused, saying how to declare it.

use super::{Conn, Proxy, Via};
use crate::error::{Error, Result};
use crate::journal::Entry;
use crate::spec::{answer, failed, holds, render, same_answer, Call, Scope, ToolSpec};
use crate::toolbox::{self, Tool};
use planarian_contracts::jsonrpc;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

pub(super) enum Policy {
    Read,
    /// SQL in the call's argument, through the server's own SQL tool.
    Sql,
    /// A Toolbox `postgres-sql` tool: its statement with the call's arguments bound.
    ToolboxSql {
        statement: String,
        params: Vec<toolbox::Param>,
        source: String,
    },
    Declared(Box<ToolSpec>),
    Pass,
    Refuse(String),
}

/// The first text of a failed answer, for a message.
fn failure_text(resp: &Value) -> String {
    let t = resp["error"]["message"].as_str().or(resp["result"]["content"][0]["text"].as_str()).unwrap_or("no message");
    t.lines().next().unwrap_or_default().chars().take(300).collect()
}

/// Whether an undo needs the call's answer.
fn mentions_result(calls: &[Call]) -> bool {
    calls.iter().any(|c| c.arguments.to_string().contains("$result"))
}

impl Proxy {
    /// The server's tools and their annotations (`tools/list`, every page), asked once and again
    /// after the server says its list changed.
    fn annotations(self: &Arc<Self>) -> Result<HashMap<String, Value>> {
        if let Some(t) = self.tools.lock().unwrap().clone() {
            return Ok(t);
        }
        let mut all = HashMap::new();
        let mut cursor: Option<Value> = None;
        loop {
            let params = match &cursor {
                Some(c) => json!({"cursor": c}),
                None => json!({}),
            };
            let resp = self.call_upstream("tools/list", params)?;
            if resp.get("error").is_some() {
                return Err(Error::Refused(format!("the server's tools/list failed: {}", failure_text(&resp))));
            }
            for t in resp["result"]["tools"].as_array().into_iter().flatten() {
                if let Some(n) = t["name"].as_str() {
                    all.insert(n.to_string(), t["annotations"].clone());
                }
            }
            match resp["result"].get("nextCursor").filter(|c| !c.is_null()) {
                Some(c) => cursor = Some(c.clone()),
                None => break,
            }
        }
        *self.tools.lock().unwrap() = Some(all.clone());
        Ok(all)
    }

    pub(super) fn forget_tools(&self) {
        *self.tools.lock().unwrap() = None;
    }

    /// The policy for `name`; `None` when only the server's annotations can tell, they were
    /// not asked yet, and `ask` is false (the caller is the client's reader, which must not
    /// wait for the server: what it decides is forwarded in the order the client sent it).
    pub(super) fn policy(self: &Arc<Self>, name: &str, ask: bool) -> Option<Policy> {
        if let Some(p) = self.policy_known(name) {
            return Some(p);
        }
        (ask || self.tools.lock().unwrap().is_some()).then(|| self.policy_by_annotations(name))
    }

    /// What the proxy itself, the specs and `--pass` say of `name` (`None`: none of them knows it).
    fn policy_known(self: &Arc<Self>, name: &str) -> Option<Policy> {
        if toolbox::is_hidden(name) {
            return Some(Policy::Refuse(format!("unknown tool {name}")));
        }
        let no_db = || {
            Policy::Refuse(format!(
                "the tool {name} runs SQL, and this proxy was started without --database (where its undo is recorded)"
            ))
        };
        if name == self.opts.sql_tool {
            return Some(if self.db.is_some() { Policy::Sql } else { no_db() });
        }
        if let Some(p) = self.opts.toolbox.as_ref().and_then(|tb| self.toolbox_policy(tb, name)) {
            return Some(p);
        }
        for spec in &self.opts.specs {
            if let Some(why) = spec.refuse.get(name) {
                return Some(Policy::Refuse(format!("the tool {name} cannot be undone: {why}")));
            }
            if let Some(t) = spec.tools.get(name) {
                return Some(Policy::Declared(Box::new(t.clone())));
            }
            if spec.reads.iter().any(|r| r == name) {
                return Some(Policy::Read);
            }
            if spec.pass.iter().any(|r| r == name) {
                return Some(Policy::Pass);
            }
        }
        if self.opts.pass.iter().any(|p| p == name || p == "*") {
            return Some(Policy::Pass);
        }
        None
    }

    /// What a Toolbox configuration says of `name`: its SQL tools, run on this database or
    /// refused (`None`: not one of them).
    fn toolbox_policy(&self, tb: &toolbox::Config, name: &str) -> Option<Policy> {
        let no_db = || {
            Policy::Refuse(format!(
                "the tool {name} runs SQL, and this proxy was started without --database (where its undo is recorded)"
            ))
        };
        let elsewhere = |source: &str| {
            let (dbname, port) = self
                .opts
                .pg_config()
                .map(|c| (c.get_dbname().map(String::from), c.get_ports().first().copied()))
                .unwrap_or((None, None));
            let dbname = dbname.or_else(|| self.opts.effective_dbname().ok()).unwrap_or_default();
            tb.elsewhere(source, &dbname, port)
                .map(|why| Policy::Refuse(format!("the Toolbox tool {name}: {why}: its changes could not be undone")))
        };
        match tb.tools.get(name) {
            Some(Tool::ExecuteSql { source }) => {
                if self.db.is_none() {
                    return Some(no_db());
                }
                Some(elsewhere(source).unwrap_or(Policy::Sql))
            }
            Some(Tool::Sql { source, statement, params, templated }) => {
                if let Some(p) = elsewhere(source) {
                    return Some(p);
                }
                if *templated {
                    return Some(Policy::Refuse(format!(
                        "the Toolbox tool {name} has templateParameters (text put into its statement), which planarian cannot classify; declare it in a spec if it only reads"
                    )));
                }
                if !tb.is_postgres(source) {
                    return Some(Policy::Refuse(format!("the Toolbox tool {name} uses the source {source}, which is not PostgreSQL: planarian cannot undo its statement")));
                }
                if self.db.is_none() {
                    return Some(no_db());
                }
                Some(Policy::ToolboxSql {
                    statement: statement.clone(),
                    params: params.clone(),
                    source: source.clone(),
                })
            }
            _ => None,
        }
    }

    fn policy_by_annotations(self: &Arc<Self>, name: &str) -> Policy {
        let tools = match self.annotations() {
            Ok(t) => t,
            Err(e) => return Policy::Refuse(format!("cannot tell whether the tool {name} changes anything: {e}")),
        };
        match tools.get(name) {
            None => Policy::Refuse(format!("the server does not list a tool {name}")),
            Some(a) if a["readOnlyHint"] == json!(true) => Policy::Read,
            Some(_) => Policy::Refuse(format!(
                "the tool {name} may change state that planarian cannot undo: the server does not mark it read-only, and no spec says how to undo it. \
                 Declare it in a spec (--spec FILE: [tools.{name}] with its capture and undo calls, or reads = [\"{name}\"] if it only reads), \
                 or let it pass unrecorded (pass = [\"{name}\"]; statepoints taken after that say they do not cover this service)"
            )),
        }
    }

    /// One `tools/call` from a client. Read on the client's reader: what needs nothing of the
    /// server to decide (a read, a pass, a refusal) is done there, in the client's order (a
    /// `notifications/cancelled` right behind the call finds it forwarded); the rest on a
    /// thread of its own (reads must not wait behind writes).
    pub(super) fn tool_call(self: &Arc<Self>, msg: Value, conn: &Arc<Conn>) {
        let name = msg["params"]["name"].as_str().unwrap_or_default().to_string();
        let disabled = self.disabled.lock().unwrap().clone();
        let quick = match disabled {
            Some(why) => Some(Policy::Refuse(why)),
            None => self.policy(&name, false),
        };
        match quick {
            Some(p @ (Policy::Read | Policy::Pass | Policy::Refuse(_))) => self.apply(p, msg, conn, name),
            _ => {
                let (me, conn) = (self.clone(), conn.clone());
                std::thread::spawn(move || {
                    let p = me.policy(&name, true).expect("a policy: the annotations were asked");
                    me.apply(p, msg, &conn, name)
                });
            }
        }
    }

    fn apply(self: &Arc<Self>, policy: Policy, msg: Value, conn: &Arc<Conn>, name: String) {
        let id = msg["id"].clone();
        let refuse = |why: String| Self::refuse(conn, &id, &why);
        match policy {
            Policy::Read => self.forward_request(msg, conn),
            Policy::Refuse(why) => {
                eprintln!("planarian-mcp-proxy: refused a call of {name}: {why}");
                refuse(why)
            }
            Policy::Pass => {
                if let Err(e) = self.positions.lock().unwrap().passed(&name) {
                    return refuse(e.to_string());
                }
                self.forward_request(msg, conn)
            }
            Policy::Sql => match msg["params"]["arguments"][&self.opts.sql_arg].as_str().map(String::from) {
                Some(sql) => self.clone().sql_call(msg, conn, sql, Via::Own),
                None => refuse(format!("the call of {name} has no \"{}\" argument", self.opts.sql_arg)),
            },
            Policy::ToolboxSql { statement, params, source } => {
                let args = msg["params"]["arguments"].clone();
                match toolbox::bind(&statement, &params, if args.is_null() { &Value::Null } else { &args }) {
                    Ok(sql) => self.clone().sql_call(msg, conn, sql, Via::Hidden(toolbox::hidden_tool(&source))),
                    Err(e) => refuse(format!("the Toolbox tool {name}: {e}")),
                }
            }
            Policy::Declared(spec) => self.declared_call(msg, conn, name, &spec),
        }
    }

    /// A call of the server's tool `call`, templated from `scope`: its answer.
    fn own_call(self: &Arc<Self>, call: &Call, scope: &Scope) -> Result<Value> {
        let args = render(&call.arguments, scope)?;
        let resp = self.call_upstream("tools/call", json!({"name": call.call, "arguments": args}))?;
        if failed(&resp) {
            return Err(Error::Refused(format!("{} failed: {}", call.call, failure_text(&resp))));
        }
        Ok(answer(&resp["result"]))
    }

    fn declared_call(self: &Arc<Self>, msg: Value, conn: &Arc<Conn>, name: String, spec: &ToolSpec) {
        let id = msg["id"].clone();
        let refuse = |why: String| Self::refuse(conn, &id, &why);
        let args = match &msg["params"]["arguments"] {
            Value::Null => json!({}),
            a => a.clone(),
        };
        let mut scope = Scope { args, ..Default::default() };
        if let Some(r) = &spec.read_if {
            match holds(r, &scope) {
                Ok(true) => return self.forward_request(msg, conn),
                Ok(false) => {}
                Err(e) => return refuse(e.to_string()),
            }
        }
        let _sandbox = match self.sandbox_lock() {
            Ok(l) => l,
            Err(e) => return refuse(e.to_string()),
        };
        let _guard = self.lock.lock().unwrap();
        if let Err(e) = self.capture_before(&name, spec, &mut scope) {
            return refuse(e.to_string());
        }
        let position = self.positions.lock().unwrap().next();
        let entry = Entry {
            position,
            tool: name.clone(),
            scope: scope.clone(),
            undo: spec.undo.clone(),
            check: spec.check.clone(),
            post: None,
        };
        if let Err(e) = self.journal.lock().unwrap().sent(entry) {
            return refuse(format!("cannot record how to undo it: {e}"));
        }
        match self.call_upstream("tools/call", msg["params"].clone()) {
            Ok(mut resp) => {
                let noted = if failed(&resp) {
                    self.journal.lock().unwrap().failed(position)
                } else {
                    scope.result = answer(&resp["result"]);
                    // (a check that cannot be read now is compared as its failure later)
                    let post = spec
                        .check
                        .as_ref()
                        .map(|c| self.own_call(c, &scope).unwrap_or_else(|e| json!({"check-failed": e.to_string()})));
                    self.journal.lock().unwrap().answered(position, scope.result.clone(), post)
                };
                if let Err(e) = noted {
                    eprintln!("planarian-mcp-proxy: {name} at position {position}: {e}");
                }
                resp["id"] = id;
                conn.send(&resp);
            }
            // (the entry stays: whether the call took effect is not known)
            Err(e) => Self::reply_error(conn, &id, jsonrpc::INTERNAL_ERROR, &e.to_string()),
        }
    }

    /// What a declared tool would change, read before it runs (its spec's `capture`, into
    /// `scope.pre`); [`Error::Refused`] with the reason to refuse the call.
    fn capture_before(self: &Arc<Self>, name: &str, spec: &ToolSpec, scope: &mut Scope) -> Result<()> {
        let Some(c) = &spec.capture else { return Ok(()) };
        match self.own_call(c, scope) {
            Ok(pre) => scope.pre = pre,
            Err(e) => {
                return Err(Error::Refused(match &spec.refuse_when_capture_fails {
                    Some(why) => format!("{name}: {why} ({e})"),
                    None => format!("{name}: cannot read what it would change: {e}"),
                }))
            }
        }
        match &spec.refuse_when_pre_contains {
            Some((needle, why)) if scope.pre.to_string().contains(needle.as_str()) => {
                Err(Error::Refused(format!("{name}: {why}")))
            }
            _ => Ok(()),
        }
    }

    /// Undoes one recorded call of a declared tool: first checks that what it left is still
    /// there, then runs its undo calls.
    pub(super) fn undo_entry(self: &Arc<Self>, e: &Entry) -> Result<()> {
        let at = format!("position {} ({})", e.position, e.tool);
        if e.scope.result.is_null() && mentions_result(&e.undo) {
            return Err(Error::Refused(format!(
                "{at}: the proxy stopped before the call's answer came, and its undo needs that answer"
            )));
        }
        if let (Some(c), Some(post)) = (&e.check, &e.post) {
            let now = self.own_call(c, &e.scope).unwrap_or_else(|err| json!({"check-failed": err.to_string()}));
            if !same_answer(&now, post, c.unordered) {
                return Err(Error::Conflict(format!("{at}: what the call left was changed since by something other than this proxy ({} answers differently)", c.call)));
            }
        }
        for u in &e.undo {
            self.own_call(u, &e.scope).map_err(|err| err.reworded(|s| format!("{at}: its undo {s}")))?;
        }
        Ok(())
    }
}
