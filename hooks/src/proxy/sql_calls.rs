//! The SQL tool's calls: classified, refused before execution when they cannot be undone,
//! numbered and rewritten to record their undo rows when they write.

use super::{Conn, Proxy, Server, Via};
use crate::error::{Error, Result};
use crate::sql::{classify, split, Class, Ddl, Statement, TableInfo, CATALOG_CHANGED};
use planarian_contracts::jsonrpc;
use serde_json::{json, Value};
use std::sync::Arc;

/// DBHub echoes each statement and its row count: put back the agent's own statements, and the
/// count a statement without RETURNING reports (the rewrite returned one empty row per change).
fn dbhub_as_original(result: &mut Value, texts: &[String], no_returning: &[usize]) {
    let Some(text) = result["content"][0]["text"].as_str() else { return };
    let Ok(mut report) = serde_json::from_str::<Value>(text) else { return };
    let Some(stmts) = report["data"]["statements"].as_array_mut() else { return };
    if stmts.len() != texts.len() {
        return;
    }
    if stmts.iter().any(|s| !s.is_object()) {
        return;
    }
    for (i, st) in stmts.iter_mut().enumerate() {
        st["sql"] = json!(texts[i]);
        if no_returning.contains(&i) {
            let n = st["rows"].as_array().map_or(0, Vec::len);
            st["rows"] = json!([]);
            st["count"] = json!(n);
        }
    }
    if let Ok(t) = serde_json::to_string_pretty(&report) {
        result["content"][0]["text"] = json!(t);
    }
}

/// The statement failed at the guard of its catalog generation (`sql::guard`).
fn failed_on_changed_catalog(resp: &Value) -> bool {
    (resp.get("error").is_some() || resp["result"]["isError"] == json!(true))
        && resp.to_string().contains(CATALOG_CHANGED)
}

impl Proxy {
    /// Whether a call of the SQL tool only reads and calls no function (nothing to check in the
    /// catalog, nothing to record), while calls are not refused.
    pub(super) fn plain_read(&self, msg: &Value) -> bool {
        let Some(sql) = msg["params"]["arguments"][&self.opts.sql_arg].as_str() else { return false };
        if self.disabled.lock().unwrap().is_some() {
            return false;
        }
        let texts = match self.opts.server {
            Server::Toolbox => vec![sql.to_string()],
            Server::Dbhub => match split(sql) {
                Ok(t) if !t.is_empty() => t,
                _ => return false,
            },
        };
        texts.iter().all(|t| matches!(classify(t), Class::ReadOnly { functions } if functions.is_empty()))
    }

    /// A statement that changes the database may call these functions: none is volatile with
    /// effects of its own.
    fn writes_may_call(&self, functions: &[String]) -> Result<()> {
        match self.db().unsafe_functions(functions) {
            Ok(bad) if bad.is_empty() => Ok(()),
            Ok(bad) => {
                Err(Error::Refused(format!("the statement calls {}, whose effects cannot be undone", bad.join(", "))))
            }
            Err(e) => Err(Error::Refused(format!("cannot check the statement: {e}"))),
        }
    }

    /// A call that carries SQL: `sql` is what it runs (a Toolbox tool's statement with its
    /// parameters bound); a write is rewritten and sent `via` the tool itself or the hidden
    /// execute tool of its source.
    pub(super) fn sql_call(self: Arc<Self>, msg: Value, conn: &Arc<Conn>, sql: String, via: Via) {
        let id = msg["id"].clone();
        let refuse = |why: String| Self::refuse(conn, &id, &why);
        if let Some(why) = self.disabled.lock().unwrap().clone() {
            return refuse(why);
        }
        let texts = match (self.opts.server, &via) {
            (Server::Dbhub, Via::Own) => match split(&sql) {
                Ok(t) if !t.is_empty() => t,
                Ok(_) => vec![sql.clone()],
                Err(e) => return refuse(e.to_string()),
            },
            _ => vec![sql.clone()],
        };
        let (functions, writes) = match sort_statements(&texts) {
            Sorted::Ddl(d) => return self.ddl_call(msg, conn, d),
            Sorted::Refused(why) => return refuse(why),
            Sorted::Dml { functions, writes } => (functions, writes),
        };
        if writes.is_empty() {
            return match self.db().unsafe_functions(&functions) {
                Ok(bad) if bad.is_empty() => self.forward_request(msg, conn),
                Ok(bad) => refuse(format!(
                    "the statement calls {}, which may change the database in ways that cannot be undone",
                    bad.join(", ")
                )),
                Err(e) => refuse(format!("cannot check the statement: {e}")),
            };
        }
        let _sandbox = match self.sandbox_lock() {
            Ok(l) => l,
            Err(e) => return refuse(e.to_string()),
        };
        let _guard = self.lock.lock().unwrap();
        if let Err(e) = self.writes_may_call(&functions) {
            return refuse(e.to_string());
        }
        // Rewritten from the catalog answers the proxy keeps; if the catalog moved on since, the
        // statement fails changing nothing, and is rewritten from fresh answers and sent again.
        for attempt in 0..2 {
            let tables = match self.tables_of(&writes, attempt > 0) {
                Ok(Some(t)) => t,
                // Unknown tables and the like: the server gives its own error, nothing changes.
                Ok(None) => return self.forward_request(msg, conn),
                Err(why) => return refuse(why),
            };
            if !self.send_writes(&msg, conn, &via, &texts, &writes, &tables, attempt == 0) {
                return;
            }
        }
    }

    /// The writes rewritten for a new position and sent `via` the tool; the answer goes to the
    /// agent, unless the statement failed on a catalog that changed and this is the `first`
    /// attempt: then `true`, to try again.
    #[allow(clippy::too_many_arguments)]
    fn send_writes(
        self: &Arc<Self>,
        msg: &Value,
        conn: &Arc<Conn>,
        via: &Via,
        texts: &[String],
        writes: &[(usize, Statement)],
        tables: &[Vec<TableInfo>],
        first: bool,
    ) -> bool {
        let id = msg["id"].clone();
        let position = self.positions.lock().unwrap().next();
        let dbhub = self.opts.server == Server::Dbhub && matches!(via, Via::Own);
        let mut sent = texts.to_vec();
        for ((i, d), t) in writes.iter().zip(tables) {
            match d.rewrite(t, position, *i, dbhub) {
                Ok(r) => sent[*i] = r,
                Err(e) => {
                    Self::refuse(conn, &id, &e.to_string());
                    return false;
                }
            }
        }
        let mut call = msg["params"].clone();
        match via {
            Via::Own => call["arguments"][&self.opts.sql_arg] = json!(sent.join(";\n")),
            Via::Hidden(tool) => {
                call["name"] = json!(tool);
                call["arguments"] = json!({"sql": sent.join(";\n")});
            }
        }
        match self.call_upstream("tools/call", call) {
            Ok(resp) if first && failed_on_changed_catalog(&resp) => return true,
            Ok(mut resp) => {
                if dbhub {
                    let no_returning: Vec<usize> =
                        writes.iter().filter(|(_, d)| !d.has_returning()).map(|(i, _)| *i).collect();
                    if let Some(result) = resp.get_mut("result") {
                        dbhub_as_original(result, texts, &no_returning);
                    }
                }
                resp["id"] = id;
                conn.send(&resp);
            }
            Err(e) => Self::reply_error(conn, &id, jsonrpc::INTERNAL_ERROR, &e.to_string()),
        }
        false
    }

    /// The tables each write touches, as the catalog says (asked again when `fresh`); `None`
    /// when one does not exist (the server's own error is then the answer), `Err` with the
    /// reason to refuse when a statement cannot be rewritten.
    fn tables_of(
        &self,
        writes: &[(usize, Statement)],
        fresh: bool,
    ) -> std::result::Result<Option<Vec<Vec<TableInfo>>>, String> {
        let mut db = self.db();
        if fresh {
            db.catalog_changed();
        }
        let mut tables = Vec::new();
        for (_, d) in writes {
            let mut infos = Vec::new();
            for part in d.dmls() {
                match db.table_info(&part.table_name()) {
                    Ok(t) => infos.push(t),
                    Err(Error::Refused(e)) if e.ends_with("does not exist") => return Ok(None),
                    Err(e) => return Err(e.to_string()),
                }
            }
            // A statement that cannot be rewritten is refused without taking a position.
            d.rewrite(&infos, 0, 0, false).map_err(|e| e.to_string())?;
            tables.push(infos);
        }
        Ok(Some(tables))
    }

    /// DDL: its inverse is recorded (its own transaction) before it runs, and forgotten if it
    /// fails.
    fn ddl_call(self: &Arc<Self>, msg: Value, conn: &Arc<Conn>, d: Ddl) {
        let id = msg["id"].clone();
        let refuse = |why: String| Self::refuse(conn, &id, &why);
        let _sandbox = match self.sandbox_lock() {
            Ok(l) => l,
            Err(e) => return refuse(e.to_string()),
        };
        let _guard = self.lock.lock().unwrap();
        // CREATE TABLE … AS runs its query: what it calls must not change the database.
        if let Some(functions) = &d.fills {
            if let Err(e) = self.writes_may_call(functions) {
                return refuse(e.to_string());
            }
        }
        let inverse = match self.db().ddl_inverse(&d) {
            Ok(Some(inv)) => inv,
            // Creates nothing: pass through, no position.
            Ok(None) => return self.forward_request(msg, conn),
            Err(e) => return refuse(e.to_string()),
        };
        self.db().catalog_changed();
        let position = self.positions.lock().unwrap().next();
        if let Err(e) = self.db().record_ddl(position, &format!("{:?}", d.object), &inverse) {
            return refuse(format!("cannot record the statement's inverse: {e}"));
        }
        match self.call_upstream("tools/call", msg["params"].clone()) {
            Ok(mut resp) => {
                if resp.get("error").is_some() || resp["result"]["isError"] == json!(true) {
                    let _ = self.db().forget(position);
                } else if d.fills.is_some() {
                    // (a failure here leaves the record without contents: undo then refuses to
                    // drop the filled table, and says so)
                    let _ = self.db().record_contents(position, &inverse);
                }
                resp["id"] = id;
                conn.send(&resp);
            }
            Err(e) => Self::reply_error(conn, &id, jsonrpc::INTERNAL_ERROR, &e.to_string()),
        }
    }
}

/// The statements of one call, sorted: one DDL statement alone, a refusal, or reads and writes
/// (the functions they call, and each write with its index).
enum Sorted {
    Ddl(Ddl),
    Refused(String),
    Dml { functions: Vec<String>, writes: Vec<(usize, Statement)> },
}

fn sort_statements(texts: &[String]) -> Sorted {
    let mut functions = Vec::new();
    let mut writes = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        match classify(text) {
            Class::Ddl(d) if texts.len() == 1 => return Sorted::Ddl(d),
            Class::Ddl(_) => {
                return Sorted::Refused(format!("statement {} ({text}): send DDL as a call of its own", i + 1))
            }
            Class::Reject(why) if texts.len() > 1 => {
                return Sorted::Refused(format!("statement {} ({text}): {why}", i + 1))
            }
            Class::Reject(why) => return Sorted::Refused(why),
            Class::ReadOnly { functions: f } => functions.extend(f),
            Class::Write(d) => {
                functions.extend(d.functions.iter().cloned());
                writes.push((i, d));
            }
        }
    }
    Sorted::Dml { functions, writes }
}
