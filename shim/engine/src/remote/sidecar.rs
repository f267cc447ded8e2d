//! The MCP state-proxy sidecar of a container: started with it (create, restore), stopped with
//! it (delete), and its position captured by every statepoint through the hook contract of
//! remote.rs (planarian-mcp-proxy is itself a remote-state hook).

use super::{Error, Result};
use crate::config::{Config, McpService};
use crate::store::ContainerStore;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use sys::Context;

const PID_FILE: &str = "mcp-proxy.pid";
const LOG_FILE: &str = "mcp-proxy.log";

/// The service this container uses, if any.
pub fn service(cfg: &Config) -> Result<Option<(&str, &McpService)>> {
    let Some(name) = cfg.mcp.service.as_deref() else { return Ok(None) };
    match cfg.mcp.services.get(name) {
        Some(s) => Ok(Some((name, s))),
        None => Err(Error::UnknownService {
            name: name.to_string(),
            known: if cfg.mcp.services.is_empty() {
                "none".to_string()
            } else {
                cfg.mcp.services.keys().cloned().collect::<Vec<_>>().join(", ")
            },
        }),
    }
}

pub fn proxy_path(cfg: &Config) -> Result<PathBuf> {
    let beside = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("planarian-mcp-proxy")));
    let configured = cfg.mcp.proxy_path.as_deref().or(beside.as_deref());
    Ok(crate::tools::locate("planarian-mcp-proxy", configured, "[mcp] proxy_path")?)
}

/// The remote-state hooks of a statepoint of this container: the configured ones, then its
/// sidecar (unless the sidecar refuses calls: a fork has no remote state of its own).
pub fn remote_hooks(cfg: &Config) -> Result<Vec<PathBuf>> {
    let mut hooks = cfg.hooks.remote.clone();
    if service(cfg)?.is_some() && cfg.mcp.disabled.is_none() {
        hooks.push(proxy_path(cfg)?);
    }
    Ok(hooks)
}

/// Whether forks of a container using this service can get a copy of its state of their own:
/// its state is a database and the upstream is told which database to use (`{dbname}` in its
/// command, URL or environment). (The proxy refuses the branch when declared tools hold state
/// a copy of the database would not carry.)
pub fn can_branch(svc: &McpService) -> bool {
    let named = |s: &str| s.contains("{dbname}");
    !svc.database.is_empty()
        && (svc.upstream.iter().any(|a| named(a)) || named(&svc.url) || svc.env.values().any(|v| named(v)))
}

fn running(store: &ContainerStore) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(store.dir.join(PID_FILE)).ok()?.trim().parse().ok()?;
    let cmdline = sys::proc::Proc::of(pid).read_bytes("cmdline").ok()?;
    String::from_utf8_lossy(&cmdline).contains("planarian-mcp-proxy").then_some(pid)
}

/// Starts the container's sidecar unless it runs already; returns once it answers.
pub fn start(cfg: &Config, id: &str) -> Result<()> {
    let Some((name, svc)) = service(cfg)? else { return Ok(()) };
    let store = ContainerStore::new(&cfg.store.path, id);
    if running(&store).is_some() {
        return Ok(());
    }
    if svc.upstream.is_empty() == svc.url.is_empty() {
        return Err(Error::ServiceIncomplete(name.to_string()));
    }
    let proxy = proxy_path(cfg)?;
    std::fs::create_dir_all(&store.dir).at("create", &store.dir)?;
    let log_path = store.dir.join(LOG_FILE);
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).at("open", &log_path)?;
    let mut cmd = proxy_command(cfg, svc, &proxy, id, &store);
    cmd.stdin(std::process::Stdio::null()).stdout(log.try_clone().at("open", &log_path)?).stderr(log);
    crate::tools::detach(&mut cmd);
    let mut child = cmd.spawn().map_err(|source| Error::Start { proxy: proxy.clone(), source })?;
    sys::write_atomic(&store.dir.join(PID_FILE), child.id().to_string().as_bytes(), 0o644)?;
    let socket = planarian_contracts::paths::control_socket(id);
    // A sidecar that ends says why at once; one that runs may start its upstream server first
    // (a Node.js server takes tens of seconds on a loaded machine): it is given two minutes.
    let end = Instant::now() + Duration::from_secs(120);
    loop {
        if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let last = log.lines().rev().find(|l| l.starts_with("planarian-mcp-proxy:")).unwrap_or("no message");
            let _ = std::fs::remove_file(store.dir.join(PID_FILE));
            return Err(Error::Exited { service: name.to_string(), status, last: last.to_string() });
        }
        if Instant::now() > end {
            stop(cfg, id);
            return Err(Error::NotUp { service: name.to_string(), log: log_path });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The sidecar's command line: the proxy serving container `id` for service `svc`.
fn proxy_command(
    cfg: &Config,
    svc: &crate::config::McpService,
    proxy: &std::path::Path,
    id: &str,
    store: &ContainerStore,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(proxy);
    cmd.args(["serve", "--container", id]);
    if !svc.database.is_empty() {
        cmd.args(["--database", &svc.database]);
    }
    for s in &svc.specs {
        cmd.args(["--spec", s]);
    }
    for t in &svc.pass {
        cmd.args(["--pass", t]);
    }
    cmd.arg("--state").arg(store.dir.join("mcp-positions.json"));
    // Its mutating calls are tool calls of the sandbox: they take its lock shared.
    cmd.arg("--lock").arg(store.dir.join("lock"));
    if !svc.server.is_empty() {
        cmd.args(["--server", &svc.server]);
    }
    if !svc.sql_tool.is_empty() {
        cmd.args(["--sql-tool", &svc.sql_tool]);
    }
    if !svc.sql_arg.is_empty() {
        cmd.args(["--sql-arg", &svc.sql_arg]);
    }
    if let Some(why) = &cfg.mcp.disabled {
        cmd.args(["--disabled", why]);
    }
    if let Some(db) = &cfg.mcp.branch {
        cmd.args(["--dbname", db]);
    }
    if !svc.http.is_empty() {
        cmd.args(["--http", &svc.http]);
    }
    if svc.url.is_empty() {
        cmd.arg("--").args(&svc.upstream).envs(&svc.env);
    } else {
        cmd.args(["--upstream-url", &svc.url]);
    }
    cmd
}

/// Stops the container's sidecar, if it runs.
pub fn stop(cfg: &Config, id: &str) {
    let store = ContainerStore::new(&cfg.store.path, id);
    if let Some(pid) = running(&store) {
        use nix::sys::signal::{kill, Signal};
        let pid = nix::unistd::Pid::from_raw(pid);
        let _ = kill(pid, Signal::SIGTERM);
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end && kill(pid, None).is_ok() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = kill(pid, Signal::SIGKILL);
    }
    let _ = std::fs::remove_file(store.dir.join(PID_FILE));
    use planarian_contracts::paths;
    for f in [paths::control_socket(id), paths::clients_socket(id), paths::url_file(id)] {
        let _ = std::fs::remove_file(f);
    }
}

/// The create hook: a container that names a service gets its sidecar before it starts.
pub fn on_create(cfg: &Config, id: &str, spec: &crate::runtime::Spec) -> Result<()> {
    let mine = spec.annotations.iter().any(|(k, _)| k.starts_with("io.planarian.mcp."));
    if !mine && cfg.mcp.service.is_none() {
        return Ok(());
    }
    let cfg = cfg.with_annotations_of(spec.annotations.iter().map(|(k, v)| (k, v)), Some("mcp"))?;
    start(&cfg, id)
}

/// The delete hook: the sidecar stops with the container's processes, except while planarian
/// rolls the container back (the stop and restore inside a rollback are not the user's).
pub fn on_delete(cfg: &Config, id: &str) {
    if RollbackMarker::active(&ContainerStore::new(&cfg.store.path, id)) {
        return;
    }
    stop(cfg, id);
}

const ROLLBACK_MARKER: &str = "rollback.pid";

/// Present while a rollback of the container runs: the pid of the planarian doing it.
pub struct RollbackMarker(PathBuf);

impl RollbackMarker {
    pub fn set(store: &ContainerStore) -> Option<RollbackMarker> {
        let p = store.dir.join(ROLLBACK_MARKER);
        sys::write_atomic(&p, std::process::id().to_string().as_bytes(), 0o644).ok()?;
        Some(RollbackMarker(p))
    }

    fn active(store: &ContainerStore) -> bool {
        let Ok(pid) = std::fs::read_to_string(store.dir.join(ROLLBACK_MARKER)) else { return false };
        // A marker left by a planarian that died is not a rollback.
        pid.trim().parse::<i32>().is_ok_and(|p| nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), None).is_ok())
    }
}

impl Drop for RollbackMarker {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
