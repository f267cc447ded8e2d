//! `planarian-mcp-proxy`: the MCP state-proxy sidecar, and the remote-state hook that talks to it.
//!
//! ```text
//! planarian-mcp-proxy serve [--database DSN] [--server toolbox|dbhub] [--sql-tool NAME] [--sql-arg ARG]
//!                           [--spec NAME|FILE]… [--pass TOOL]… [--toolbox-config FILE]… [--container ID]
//!                           [--control SOCKET] [--state FILE] [--listen SOCKET] [--http ADDR:PORT]
//!                           [--disabled REASON]   (-- UPSTREAM-COMMAND [ARGS…] | --upstream-url URL)
//! planarian-mcp-proxy connect CONTAINER-ID             (stdio MCP server for a harness: the
//!                                                       container's sidecar, over its socket)
//! planarian-mcp-proxy url CONTAINER-ID                 (the sidecar's Streamable HTTP endpoint)
//! planarian-mcp-proxy capture CONTAINER-ID             (the hook contract of planarian)
//! planarian-mcp-proxy compensate CONTAINER-ID POSITION
//! planarian-mcp-proxy branch CONTAINER-ID POSITION NEW-CONTAINER-ID   (a fork's own database)
//! planarian-mcp-proxy unbranch CONTAINER-ID NEW-CONTAINER-ID          (… dropped: the fork failed)
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
mod error;
mod http;
mod httpd;
mod journal;
mod proxy;
mod spec;
mod sql;
mod state;
mod toolbox;

use crate::error::{Error, Result};
use planarian_contracts::control::{self as contract, Request};
use planarian_contracts::{hook, paths};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One JSON line on stdout: what planarian reads of a hook verb.
fn print_line<T: serde::Serialize>(t: &T) {
    println!("{}", serde_json::to_string(t).expect("a hook's answer encodes"));
}

/// Bridges stdio to a listening sidecar: what a harness runs as its "stdio MCP server".
///
/// Plain read/write loops, not `std::io::copy`: between a socket and a pipe that uses
/// splice(2), and in the guest (Linux 6.1) answers spliced from the sidecar's socket into the
/// harness's pipe were sometimes never delivered.
fn connect(path: &std::path::Path) -> Result<()> {
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
    let stream = UnixStream::connect(path)
        .map_err(|e| Error::Refused(format!("no MCP proxy for this container at {}: {e}", path.display())))?;
    let to_proxy = stream.try_clone().map_err(Error::file("use", path))?;
    std::thread::spawn(move || {
        let _ = pump(std::io::stdin(), &to_proxy);
        let _ = to_proxy.shutdown(std::net::Shutdown::Write);
    });
    pump(&stream, std::io::stdout()).map_err(Error::file("relay", path))
}

/// The proxy's command line.
#[derive(clap::Parser, Debug)]
#[command(name = "planarian-mcp-proxy", about = "The MCP state proxy of planarian, and its remote-state hook")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Serve MCP to a harness (stdio, a socket, or Streamable HTTP) in front of a real server.
    Serve(Box<Serve>),
    /// A stdio MCP server for a harness: the container's sidecar, over its socket.
    Connect { container: String },
    /// The sidecar's Streamable HTTP endpoint.
    Url { container: String },
    /// The hook contract of planarian: the current position, as JSON.
    Capture { container: String },
    /// The hook contract of planarian: undo every call after POSITION.
    Compensate { container: String, position: u64 },
    /// The hook contract of planarian: a copy of the database at POSITION for the fork
    /// NEW-CONTAINER-ID; prints its endpoint as JSON.
    Branch { container: String, position: u64, new_container: String },
    /// The hook contract of planarian: drop the copy made for the fork NEW-CONTAINER-ID, which
    /// failed.
    Unbranch { container: String, new_container: String },
    /// Talk to a proxy's control socket.
    Control {
        socket: PathBuf,
        #[command(subcommand)]
        op: ControlOp,
    },
}

#[derive(clap::Subcommand, Debug)]
enum ControlOp {
    Position,
    Status,
    Compensate { position: u64 },
    Branch { at: u64, container: String },
    Unbranch { container: String },
    Disable { reason: Option<String> },
}

#[derive(clap::Args, Debug)]
struct Serve {
    /// The database the SQL tools write to (where undo rows are kept); none for a server
    /// without SQL.
    #[arg(long = "database")]
    dsn: Option<String>,
    /// Declared compensations: a builtin spec (memory, filesystem) or a TOML file.
    #[arg(long = "spec")]
    specs: Vec<String>,
    /// Let this tool through unrecorded (`*`: every tool nothing else classified); statepoints
    /// taken after such a call say they do not cover this service.
    #[arg(long)]
    pass: Vec<String>,
    /// MCP Toolbox's tool configuration, when the proxy does not start Toolbox itself (with
    /// `--upstream-url`); otherwise it is read from Toolbox's command line.
    #[arg(long = "toolbox-config")]
    toolbox_config: Vec<PathBuf>,
    /// Use this database instead of the one the DSN names (a fork's branch); it also replaces
    /// `{dbname}` in the upstream command, its environment and its URL.
    #[arg(long)]
    dbname: Option<String>,
    /// How the server's SQL tool takes statements.
    #[arg(long, value_enum, default_value = "toolbox")]
    server: ServerKind,
    #[arg(long, default_value = "execute_sql")]
    sql_tool: String,
    #[arg(long, default_value = "sql")]
    sql_arg: String,
    /// The container this sidecar belongs to (names its sockets and positions file).
    #[arg(long)]
    container: Option<String>,
    #[arg(long)]
    control: Option<PathBuf>,
    /// Where the call positions are kept.
    #[arg(long)]
    state: Option<PathBuf>,
    /// The sandbox's lock file: mutating calls hold it shared (they wait for its snapshots).
    #[arg(long)]
    lock: Option<PathBuf>,
    /// Serve clients on this Unix socket.
    #[arg(long)]
    listen: Option<PathBuf>,
    /// Serve Streamable HTTP on this loopback ADDR:PORT.
    #[arg(long)]
    http: Option<String>,
    /// Refuse every SQL call with this reason (a fork).
    #[arg(long)]
    disabled: Option<String>,
    /// The real server over Streamable HTTP …
    #[arg(long, conflicts_with = "upstream")]
    upstream_url: Option<String>,
    /// … or the command that starts it (over stdio).
    #[arg(last = true)]
    upstream: Vec<String>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ServerKind {
    /// MCP Toolbox: one statement per call.
    Toolbox,
    /// DBHub: several statements in one call.
    Dbhub,
}

fn main() {
    use clap::Parser;
    let cli = Cli::parse();
    let socket = paths::control_socket;
    let r: Result<()> = match cli.command {
        Cmd::Serve(a) => serve(*a),
        Cmd::Connect { container } => connect(&paths::clients_socket(&container)),
        Cmd::Url { container } => std::fs::read_to_string(paths::url_file(&container))
            .map(|u| println!("{}", u.trim()))
            .map_err(|_| Error::Invalid(format!("the MCP proxy of container {container} serves no HTTP endpoint (set http in its [mcp.services] entry)"))),
        Cmd::Capture { container } => {
            // planarian passes the position of the statepoint's parent: what changed since.
            let since = std::env::var(hook::SINCE_POSITION_ENV).ok().and_then(|p| p.parse::<u64>().ok());
            contract::ask::<contract::Position>(&socket(&container), &Request::Position { since }).map(|p| {
                let out = hook::Capture {
                    external_endpoint: Some(format!("mcp-proxy:{}", socket(&container).display())),
                    mcp_call_position: p.position,
                    calls_since_parent: p.calls,
                    tables_since_parent: p.tables,
                    uncovered: p.uncovered,
                };
                print_line(&out);
            })
            .map_err(Error::from)
        }
        Cmd::Compensate { container, position } => {
            contract::ask::<contract::Compensated>(&socket(&container), &Request::Compensate { to: position })
                .map(drop)
                .map_err(Error::from)
        }
        Cmd::Branch { container, position, new_container } => contract::ask::<contract::Branched>(
            &socket(&container),
            &Request::Branch { at: position, container: new_container.clone() },
        )
        .map(|b| {
            print_line(&hook::Branch {
                external_endpoint: Some(format!("mcp-proxy:{}", socket(&new_container).display())),
                database: b.database,
                mcp_call_position: Some(position),
            })
        })
        .map_err(Error::from),
        Cmd::Unbranch { container, new_container } => {
            contract::ask::<contract::Unbranched>(&socket(&container), &Request::Unbranch { container: new_container })
                .map(drop)
                .map_err(Error::from)
        }
        Cmd::Control { socket, op } => {
            let req = match op {
                ControlOp::Position => Request::Position { since: None },
                ControlOp::Status => Request::Status,
                ControlOp::Compensate { position } => Request::Compensate { to: position },
                ControlOp::Branch { at, container } => Request::Branch { at, container },
                ControlOp::Unbranch { container } => Request::Unbranch { container },
                ControlOp::Disable { reason } => Request::Disable { reason: reason.unwrap_or_default() },
            };
            // (printed as the sidecar answered: for people and tests)
            contract::ask::<serde_json::Value>(&socket, &req).map(|v| println!("{v}")).map_err(Error::from)
        }
    };
    if let Err(e) = r {
        // One line: planarian reads the last line of a hook's errors.
        eprintln!("planarian-mcp-proxy: {}", e.to_string().replace('\n', " "));
        std::process::exit(1);
    }
}

fn serve(a: Serve) -> Result<()> {
    let container = a.container;
    let dsn = a.dsn;
    let mut upstream = a.upstream;
    let control = a.control.or_else(|| container.as_deref().map(paths::control_socket));
    let state_file = a
        .state
        .or_else(|| container.as_deref().map(|c| PathBuf::from("/var/lib/planarian/mcp").join(format!("{c}.json"))))
        .ok_or_else(|| {
            Error::Invalid("serve needs --state FILE or --container ID (where the call positions are kept)".into())
        })?;
    let server = match a.server {
        ServerKind::Toolbox => proxy::Server::Toolbox,
        ServerKind::Dbhub => proxy::Server::Dbhub,
    };
    let (specs, toolbox) = tools_of(&a.specs, &a.toolbox_config, &mut upstream, &state_file)?;
    let mut opts = proxy::Options {
        upstream,
        upstream_url: None,
        server,
        sql_tool: a.sql_tool,
        sql_arg: a.sql_arg,
        dsn,
        specs,
        pass: a.pass,
        toolbox,
        dbname: a.dbname,
        state_file,
        disabled: a.disabled,
        sandbox_lock: a.lock,
    };
    let dbname = opts.effective_dbname()?;
    opts.upstream_url = a.upstream_url.map(|u| http::Url::parse(&u.replace("{dbname}", &dbname))).transpose()?;
    let (upstream, upstream_url) = (&opts.upstream, &opts.upstream_url);
    if upstream.is_empty() && upstream_url.is_none() && opts.disabled.is_none() {
        return Err(Error::Invalid("serve needs -- UPSTREAM-COMMAND or --upstream-url URL".into()));
    }
    let http_listener = a.http.map(|addr| httpd::bind(&addr)).transpose()?;
    let listen = a.listen.or_else(|| container.as_deref().map(paths::clients_socket));
    let proxy = proxy::Proxy::new(opts)?;
    if let Some(path) = &control {
        control::listen(path, proxy.clone())?;
    }
    serve_clients(&proxy, container.as_deref(), control.as_deref(), listen.as_deref(), http_listener)
}

/// The specs named (Toolbox's prebuilt PostgreSQL set's added when the upstream is one) and
/// Toolbox's own tools: from `toolbox_config`, or from its command line in `upstream` (which
/// then gets the hidden execute tools, their file beside `state_file`).
fn tools_of(
    specs: &[String],
    toolbox_config: &[PathBuf],
    upstream: &mut Vec<String>,
    state_file: &Path,
) -> Result<(Vec<spec::Spec>, Option<toolbox::Config>)> {
    let mut names = specs.to_vec();
    // Toolbox's prebuilt PostgreSQL set: the reads it does not annotate (hooks/specs).
    let prebuilt = upstream.windows(2).any(|w| w[0] == "--prebuilt" && w[1].contains("postgres"))
        || upstream.iter().any(|a| a.starts_with("--prebuilt=") && a.contains("postgres"));
    if prebuilt && !names.iter().any(|n| n == "toolbox-postgres") {
        names.push("toolbox-postgres".into());
    }
    let specs = names.iter().map(|s| spec::Spec::load(s)).collect::<Result<Vec<_>, _>>()?;
    let found = toolbox::config_args(upstream.get(1..).unwrap_or_default());
    let toolbox = if !toolbox_config.is_empty() {
        Some(toolbox::Config::load(toolbox_config)?)
    } else if let Some((_, _, files)) = found.first() {
        let config = toolbox::Config::load(files)?;
        let extra = state_file.with_extension("toolbox.yaml");
        let args = toolbox::with_hidden_tools(&upstream[1..], &config, &extra)?;
        upstream.truncate(1);
        upstream.extend(args);
        Some(config)
    } else {
        None
    };
    Ok((specs, toolbox))
}

/// Serves the proxy's clients: on the HTTP listener, if any (alone when there is no
/// container), on the clients' socket of a sidecar, or on stdin and stdout; then shuts down.
fn serve_clients(
    proxy: &Arc<proxy::Proxy>,
    container: Option<&str>,
    control: Option<&Path>,
    listen: Option<&Path>,
    http_listener: Option<std::net::TcpListener>,
) -> Result<()> {
    let url_file = container.map(paths::url_file);
    if let Some(listener) = http_listener {
        let url = format!(
            "http://{}/mcp",
            listener.local_addr().map_err(|e| Error::Invalid(format!("the HTTP listener: {e}")))?
        );
        eprintln!("planarian-mcp-proxy: serving MCP (Streamable HTTP) at {url}");
        if let Some(f) = &url_file {
            std::fs::write(f, format!("{url}\n")).map_err(Error::file("write", f))?;
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
    for f in control.into_iter().chain(url_file.as_deref()) {
        let _ = std::fs::remove_file(f);
    }
    Ok(())
}
