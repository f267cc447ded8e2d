//! The control interface for the shim: one JSON request per connection on a Unix socket.
//!
//! `{"op":"position"}` → `{"position":N}` (taken under the proxy lock), with `"since":P` also
//! `"calls"` and `"tables"`: how many calls after P changed something, and what;
//! `{"op":"compensate","to":P}` → `{"position":P,"rows":R}` or `{"error":"…"}`;
//! `{"op":"branch","at":P,"container":ID}` → `{"database":NAME}`: a copy of the database at
//! position P for the fork ID; `{"op":"unbranch","container":ID}` → `{"dropped":NAME}`: that
//! copy dropped (a fork that failed);
//! `{"op":"disable","reason":"…"}` → `{"disabled":true}`; `{"op":"status"}` → the proxy's state.

use crate::proxy::Proxy;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

/// Listens on `path`, taking it over from a proxy that is gone (never from a live one).
pub fn bind(path: &Path) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if UnixStream::connect(path).is_ok() {
        return Err(format!("another proxy already listens on {}", path.display()));
    }
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))
}

pub fn listen(path: &Path, proxy: Arc<Proxy>) -> Result<(), String> {
    let listener = bind(path)?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let proxy = proxy.clone();
            std::thread::spawn(move || handle(conn, &proxy));
        }
    });
    Ok(())
}

fn handle(conn: UnixStream, proxy: &Arc<Proxy>) {
    let mut line = String::new();
    if BufReader::new(&conn).read_line(&mut line).is_err() {
        return;
    }
    let req: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
    let resp = match req["op"].as_str() {
        Some("position") => match proxy.capture() {
            Ok(p) => {
                let uncovered = proxy.uncovered();
                match req["since"].as_u64().map(|since| proxy.changes(since, p)) {
                    None => json!({"position": p, "uncovered": uncovered}),
                    Some(Ok((calls, tables))) => json!({"position": p, "calls": calls, "tables": tables, "uncovered": uncovered}),
                    Some(Err(e)) => json!({"error": e}),
                }
            }
            Err(e) => json!({"error": e}),
        },
        Some("compensate") => match req["to"].as_u64() {
            Some(to) => match proxy.compensate(to) {
                Ok(rows) => json!({"position": to, "rows": rows}),
                Err(e) => json!({"error": e}),
            },
            None => json!({"error": "compensate needs \"to\": a position"}),
        },
        Some("disable") => {
            let why = req["reason"].as_str().unwrap_or("database calls are disabled for this sandbox").to_string();
            proxy.disable(why);
            json!({"disabled": true})
        }
        Some("status") => proxy.status(),
        Some("branch") => match (req["at"].as_u64(), req["container"].as_str()) {
            (Some(at), Some(c)) => match proxy.branch(at, c) {
                Ok(name) => json!({"database": name}),
                Err(e) => json!({"error": e}),
            },
            _ => json!({"error": "branch needs \"at\": a position and \"container\": the fork's ID"}),
        },
        Some("unbranch") => match req["container"].as_str() {
            Some(c) => match proxy.unbranch(c) {
                Ok(name) => json!({"dropped": name}),
                Err(e) => json!({"error": e}),
            },
            None => json!({"error": "unbranch needs \"container\": the fork's ID"}),
        },
        _ => json!({"error": "unknown request: expected op position, compensate, branch, unbranch, disable or status"}),
    };
    let mut conn = conn;
    let _ = conn.write_all(format!("{resp}\n").as_bytes());
}

/// One request to a proxy's control socket.
pub fn request(path: &Path, req: &Value) -> Result<Value, String> {
    let mut conn = UnixStream::connect(path).map_err(|e| format!("no MCP proxy at {}: {e}", path.display()))?;
    conn.write_all(format!("{req}\n").as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&line).map_err(|e| format!("{}: bad answer: {e}", path.display()))?;
    match v["error"].as_str() {
        Some(e) => Err(e.to_string()),
        None => Ok(v),
    }
}
