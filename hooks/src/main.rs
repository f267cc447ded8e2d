//! `planarian-mcp-proxy`: the MCP state-proxy sidecar, and the remote-state hook that talks to it.
//!
//! ```text
//! planarian-mcp-proxy serve --database DSN [--server toolbox|dbhub] [--sql-tool NAME] [--sql-arg ARG] [--container ID]
//!                           [--control SOCKET] [--state FILE] [--listen SOCKET] [--http ADDR:PORT]
//!                           [--disabled REASON]   (-- UPSTREAM-COMMAND [ARGS…] | --upstream-url URL)
//! planarian-mcp-proxy connect CONTAINER-ID             (stdio MCP server for a harness: the
//!                                                       container's sidecar, over its socket)
//! planarian-mcp-proxy url CONTAINER-ID                 (the sidecar's Streamable HTTP endpoint)
//! planarian-mcp-proxy capture CONTAINER-ID             (the hook contract of planarian)
//! planarian-mcp-proxy compensate CONTAINER-ID POSITION
//! planarian-mcp-proxy control SOCKET position|status|compensate P|disable [REASON]
//! ```
//!
//! `serve` speaks MCP over stdio to the harness (or, with `--listen`, to every client of a Unix
//! socket: the sidecar planarian starts for a container; with `--http`, Streamable HTTP on a
//! loopback address) and spawns the real server over stdio or reaches it by URL. The
//! control socket defaults to `$PLANARIAN_MCP_DIR/<container>.sock` (`/run/planarian/mcp`), the
//! positions file to `/var/lib/planarian/mcp/<container>.json`; the hook finds the socket the
//! same way from the container ID planarian passes it.

mod control;
mod db;
mod http;
mod httpd;
mod proxy;
mod sql;
mod state;

use serde_json::json;
use std::path::PathBuf;

fn socket_for(container: &str) -> PathBuf {
    let dir = std::env::var_os("PLANARIAN_MCP_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/run/planarian/mcp"));
    dir.join(format!("{container}.sock"))
}

fn clients_socket_for(container: &str) -> PathBuf {
    socket_for(container).with_extension("mcp")
}

fn url_file_for(container: &str) -> PathBuf {
    socket_for(container).with_extension("url")
}

/// Bridges stdio to a listening sidecar: what a harness runs as its "stdio MCP server".
///
/// Plain read/write loops, not `std::io::copy`: between a socket and a pipe that uses
/// splice(2), and in the guest (Linux 6.1) answers spliced from the sidecar's socket into the
/// harness's pipe were sometimes never delivered.
fn connect(path: &std::path::Path) -> Result<(), String> {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    fn pump(mut from: impl Read, mut to: impl Write) -> std::io::Result<()> {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            to.write_all(&buf[..n])?;
            to.flush()?;
        }
    }
    let stream = UnixStream::connect(path).map_err(|e| format!("no MCP proxy for this container at {}: {e}", path.display()))?;
    let to_proxy = stream.try_clone().map_err(|e| e.to_string())?;
    std::thread::spawn(move || {
        let _ = pump(std::io::stdin(), &to_proxy);
        let _ = to_proxy.shutdown(std::net::Shutdown::Write);
    });
    pump(&stream, std::io::stdout()).map_err(|e| e.to_string())
}

fn usage() -> String {
    "usage: planarian-mcp-proxy serve --database DSN [--server toolbox|dbhub] [--sql-tool NAME] [--sql-arg ARG] [--container ID] [--control SOCKET] [--state FILE] [--listen SOCKET] [--http ADDR:PORT] (-- UPSTREAM… | --upstream-url URL)\n       planarian-mcp-proxy connect CONTAINER-ID | url CONTAINER-ID\n       planarian-mcp-proxy capture CONTAINER-ID | compensate CONTAINER-ID POSITION\n       planarian-mcp-proxy control SOCKET position|status|compensate P|disable [REASON]".into()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("connect") if args.len() == 2 => connect(&clients_socket_for(&args[1])),
        Some("url") if args.len() == 2 => std::fs::read_to_string(url_file_for(&args[1]))
            .map(|u| println!("{}", u.trim()))
            .map_err(|_| format!("the MCP proxy of container {} serves no HTTP endpoint (set http in its [mcp.services] entry)", args[1])),
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
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let (flags, upstream) = (&args[..split], args.get(split + 1..).unwrap_or_default().to_vec());
    let mut get = std::collections::HashMap::new();
    let mut it = flags.iter();
    while let Some(f) = it.next() {
        let v = it.next().ok_or_else(|| format!("{f} needs a value"))?;
        match f.as_str() {
            "--database" | "--server" | "--sql-tool" | "--sql-arg" | "--container" | "--control" | "--state" | "--listen"
            | "--disabled" | "--http" | "--upstream-url" => {
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
    let upstream_url = get.remove("upstream-url").map(|u| http::Url::parse(&u)).transpose()?;
    match (upstream.is_empty(), upstream_url.is_some()) {
        (true, false) => return Err(format!("serve needs -- UPSTREAM-COMMAND or --upstream-url URL\n{}", usage())),
        (false, true) => return Err("serve takes either -- UPSTREAM-COMMAND or --upstream-url, not both".into()),
        _ => {}
    }
    let http_listener = get.remove("http").map(|a| httpd::bind(&a)).transpose()?;
    let opts = proxy::Options {
        upstream,
        upstream_url,
        server,
        sql_tool: get.remove("sql-tool").unwrap_or_else(|| "execute_sql".into()),
        sql_arg: get.remove("sql-arg").unwrap_or_else(|| "sql".into()),
        dsn,
        state_file,
        disabled: get.remove("disabled"),
    };
    let listen = get.remove("listen").map(PathBuf::from).or_else(|| container.as_deref().map(clients_socket_for));
    let proxy = proxy::Proxy::new(opts)?;
    if let Some(path) = &control {
        control::listen(path, proxy.clone())?;
    }
    let url_file = container.as_deref().map(url_file_for);
    if let Some(listener) = http_listener {
        let url = format!("http://{}/mcp", listener.local_addr().map_err(|e| e.to_string())?);
        eprintln!("planarian-mcp-proxy: serving MCP (Streamable HTTP) at {url}");
        if let Some(f) = &url_file {
            std::fs::write(f, format!("{url}\n")).map_err(|e| format!("cannot write {}: {e}", f.display()))?;
        }
        if container.is_none() {
            // Only HTTP: it serves until the proxy is stopped.
            httpd::serve(proxy.clone(), listener);
            proxy.shutdown();
            return Ok(());
        }
        let proxy = proxy.clone();
        std::thread::spawn(move || httpd::serve(proxy, listener));
    }
    match (&listen, container.is_some()) {
        // A sidecar: clients come and go on the socket until the proxy is stopped.
        (Some(path), true) => {
            let listener = control::bind(path)?;
            for conn in listener.incoming().flatten() {
                let Ok(out) = conn.try_clone() else { continue };
                let proxy = proxy.clone();
                std::thread::spawn(move || proxy.serve(std::io::BufReader::new(conn), proxy::Conn::new(Box::new(out))));
            }
        }
        _ => proxy.serve(std::io::stdin().lock(), proxy::Conn::new(Box::new(std::io::stdout()))),
    }
    proxy.shutdown();
    for f in control.iter().chain(&url_file) {
        let _ = std::fs::remove_file(f);
    }
    Ok(())
}
