//! `planarian-mcp-proxy`: the MCP state-proxy sidecar, and the remote-state hook that talks to it.
//!
//! ```text
//! planarian-mcp-proxy serve --database DSN [--server toolbox|dbhub] [--sql-tool NAME] [--sql-arg ARG] [--container ID]
//!                           [--control SOCKET] [--state FILE] -- UPSTREAM-COMMAND [ARGS…]
//! planarian-mcp-proxy capture CONTAINER-ID             (the hook contract of planarian)
//! planarian-mcp-proxy compensate CONTAINER-ID POSITION
//! planarian-mcp-proxy control SOCKET position|status|compensate P|disable [REASON]
//! ```
//!
//! `serve` speaks MCP over stdio to the harness and spawns the real server over stdio. The
//! control socket defaults to `$PLANARIAN_MCP_DIR/<container>.sock` (`/run/planarian/mcp`), the
//! positions file to `/var/lib/planarian/mcp/<container>.json`; the hook finds the socket the
//! same way from the container ID planarian passes it.

mod control;
mod db;
mod proxy;
mod sql;
mod state;

use serde_json::json;
use std::path::PathBuf;

fn socket_for(container: &str) -> PathBuf {
    let dir = std::env::var_os("PLANARIAN_MCP_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/run/planarian/mcp"));
    dir.join(format!("{container}.sock"))
}

fn usage() -> String {
    "usage: planarian-mcp-proxy serve --database DSN [--server toolbox|dbhub] [--sql-tool NAME] [--sql-arg ARG] [--container ID] [--control SOCKET] [--state FILE] -- UPSTREAM…\n       planarian-mcp-proxy capture CONTAINER-ID | compensate CONTAINER-ID POSITION\n       planarian-mcp-proxy control SOCKET position|status|compensate P|disable [REASON]".into()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("capture") if args.len() == 2 => control::request(&socket_for(&args[1]), &json!({"op": "position"})).map(|v| {
            println!("{}", json!({"external-endpoint": format!("mcp-proxy:{}", socket_for(&args[1]).display()), "mcp-call-position": v["position"]}));
        }),
        Some("compensate") if args.len() == 3 => match args[2].parse::<u64>() {
            Ok(to) => control::request(&socket_for(&args[1]), &json!({"op": "compensate", "to": to})).map(drop),
            Err(_) => Err(format!("not a position: {}", args[2])),
        },
        Some("control") if args.len() >= 3 => {
            let req = match (args[2].as_str(), args.get(3)) {
                ("position", None) => Ok(json!({"op": "position"})),
                ("status", None) => Ok(json!({"op": "status"})),
                ("compensate", Some(p)) => p.parse::<u64>().map(|to| json!({"op": "compensate", "to": to})).map_err(|_| format!("not a position: {p}")),
                ("disable", why) => Ok(json!({"op": "disable", "reason": why})),
                _ => Err(usage()),
            };
            req.and_then(|req| control::request(&PathBuf::from(&args[1]), &req)).map(|v| println!("{v}"))
        }
        _ => Err(usage()),
    };
    if let Err(e) = r {
        eprintln!("planarian-mcp-proxy: {e}");
        std::process::exit(if e.starts_with("usage:") { 2 } else { 1 });
    }
}

fn serve(args: &[String]) -> Result<(), String> {
    let split = args.iter().position(|a| a == "--").ok_or_else(|| format!("serve needs -- UPSTREAM-COMMAND\n{}", usage()))?;
    let (flags, upstream) = (&args[..split], args[split + 1..].to_vec());
    let mut get = std::collections::HashMap::new();
    let mut it = flags.iter();
    while let Some(f) = it.next() {
        let v = it.next().ok_or_else(|| format!("{f} needs a value"))?;
        match f.as_str() {
            "--database" | "--server" | "--sql-tool" | "--sql-arg" | "--container" | "--control" | "--state" => {
                get.insert(f.trim_start_matches('-').to_string(), v.clone());
            }
            _ => return Err(format!("unknown option {f}\n{}", usage())),
        }
    }
    let dsn = get.remove("database").ok_or("serve needs --database DSN (the database the SQL tool writes to)")?;
    let container = get.remove("container");
    let control = get.remove("control").map(PathBuf::from).or_else(|| container.as_deref().map(socket_for));
    let state_file = get
        .remove("state")
        .map(PathBuf::from)
        .or_else(|| container.as_deref().map(|c| PathBuf::from("/var/lib/planarian/mcp").join(format!("{c}.json"))))
        .ok_or("serve needs --state FILE or --container ID (where the call positions are kept)")?;
    let server = match get.remove("server").as_deref() {
        None | Some("toolbox") => proxy::Server::Toolbox,
        Some("dbhub") => proxy::Server::Dbhub,
        Some(other) => return Err(format!("unknown --server {other}: toolbox (one statement per call) or dbhub (several)")),
    };
    let opts = proxy::Options {
        upstream,
        server,
        sql_tool: get.remove("sql-tool").unwrap_or_else(|| "execute_sql".into()),
        sql_arg: get.remove("sql-arg").unwrap_or_else(|| "sql".into()),
        dsn,
        state_file,
    };
    let proxy = proxy::Proxy::new(opts, Box::new(std::io::stdout()))?;
    if let Some(path) = &control {
        control::listen(path, proxy.clone())?;
    }
    proxy.serve(std::io::stdin().lock());
    if let Some(path) = &control {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
