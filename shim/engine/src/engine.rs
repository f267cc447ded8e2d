//! The engine's front door: [`Engine`], made once by a binary (the runtime verb, a command, the
//! MCP server, a background worker) and handed to every operation.
//!
//! It holds what every operation needs and none looks up again: the configuration (read once,
//! each container's annotations applied on top by the operation that loads it), the runtime's
//! global flags (`--root`, `--systemd-cgroup`), and the tools it drives (crun, CRIU), each found
//! once, on first use — so a verb crun answers alone (`state`, `list`) never looks for CRIU.

use crate::config::{Config, ConfigError};
use crate::runtime::{self, Bundle, Globals};
use crate::statepoint;
use crate::store::ContainerStore;
use crate::tools::NotFound;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The configuration, the runtime's global flags and the tools: what every operation starts
/// from (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Engine {
    cfg: Config,
    globals: Globals,
    crun: OnceLock<PathBuf>,
    criu: OnceLock<PathBuf>,
}

impl Engine {
    /// Reads the configuration (`/etc/planarian/planarian.conf` and its drop-ins, or
    /// `PLANARIAN_CONFIG`).
    pub fn load(globals: Globals) -> Result<Engine, ConfigError> {
        Ok(Engine::with_config(Config::load()?, globals))
    }

    /// An engine with a configuration already read.
    pub fn with_config(cfg: Config, globals: Globals) -> Engine {
        Engine { cfg, globals, crun: OnceLock::new(), criu: OnceLock::new() }
    }

    /// The same engine with other global flags (a worker told them by the process that started
    /// it; a CRI engine's container, found under containerd's `--root`).
    pub fn with_globals(&self, globals: Globals) -> Engine {
        Engine { globals, ..self.clone() }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn globals(&self) -> &Globals {
        &self.globals
    }

    /// crun, found once ([`runtime::crun`]).
    pub fn crun(&self) -> Result<&Path, NotFound> {
        once(&self.crun, || runtime::crun(&self.cfg))
    }

    /// CRIU, found once ([`runtime::criu`]).
    pub fn criu(&self) -> Result<&Path, NotFound> {
        once(&self.criu, || runtime::criu(&self.cfg))
    }

    /// The statepoint registry of the container with full ID `id` (which may have none yet).
    pub fn store(&self, id: &str) -> ContainerStore {
        ContainerStore::new(&self.cfg.store.path, id)
    }

    /// `create`: what planarian adds before crun creates container `id` from `bundle` — its
    /// root file system on a ZFS dataset when so configured (the bundle's config then points
    /// there), and the sidecar of the MCP service it names.
    pub fn on_create(&self, id: &str, bundle: &mut Bundle) -> Result<(), statepoint::Error> {
        crate::local::zfs::create::on_create(&self.cfg, id, bundle)?;
        crate::remote::sidecar::on_create(&self.cfg, id, &bundle.spec)?;
        Ok(())
    }

    /// `delete`: the container's sidecar and dataset go with it.
    pub fn on_delete(&self, id: &str) {
        crate::remote::sidecar::on_delete(&self.cfg, id);
        crate::local::zfs::on_delete(&self.cfg, id);
    }

    /// `exec` (a tool call) in container `id`: its shared lock, so that the call cannot start
    /// while a snapshot or rollback holds the exclusive one — as a descriptor crun inherits and
    /// holds until it exits. None for a container without statepoints.
    pub fn tool_call_lock(&self, id: &str) -> Result<Option<std::fs::File>, statepoint::Error> {
        let store = self.store(id);
        if !store.dir.exists() {
            return Ok(None);
        }
        let f = store.lock(false)?;
        nix::fcntl::fcntl(&f, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
            .map_err(|e| sys::IoError::new("pass to crun the lock", &store.dir, e.into()))?;
        Ok(Some(f))
    }

    /// `exec` with conmon's process file `file`: what the tool call leaves running must be in
    /// a session CRIU can dump ([`runtime::exec`]); crun 1.20 and later give it one already.
    pub fn prepare_exec(&self, id: &str, file: &Path) {
        let Ok(crun) = self.crun() else { return };
        if runtime::exec::runtime_gives_exec_a_session(crun) {
            return;
        }
        if let Ok(pid) = runtime::Container::load(crun, &self.globals, id).and_then(|c| c.running_pid()) {
            runtime::exec::rewrite_process_file(file, pid);
        }
    }

    /// conmon's `exec --detach` of `what` in container `id`, started as process `pid`: the
    /// tool call's `lock` is held until the command exits (in a holder of its own,
    /// [`runtime::inflight`]), so a snapshot waits for it.
    pub fn hold_tool_call(&self, lock: std::fs::File, id: &str, pid: i32, what: &str) -> Result<(), String> {
        let store = self.store(id);
        runtime::inflight::hold_until_exit(lock, pid, &store.dir, what, self.cfg.checkpoint.in_flight_wait())
    }
}

fn once(cell: &OnceLock<PathBuf>, find: impl FnOnce() -> Result<PathBuf, NotFound>) -> Result<&Path, NotFound> {
    if let Some(p) = cell.get() {
        return Ok(p);
    }
    let found = find()?;
    Ok(cell.get_or_init(|| found))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_is_found_once_and_a_missing_one_is_told() {
        let mut cfg = Config::default();
        cfg.runtime.crun_path = Some("/bin/sh".into());
        cfg.runtime.criu_path = Some("/nonexistent/criu".into());
        let e = Engine::with_config(cfg, Globals::default());
        assert_eq!(e.crun().unwrap(), Path::new("/bin/sh"));
        assert!(std::ptr::eq(e.crun().unwrap(), e.crun().unwrap()), "found once");
        let err = e.criu().unwrap_err().to_string();
        assert!(err.contains("/nonexistent/criu") && err.contains("criu_path"), "{err}");
        let other = e.with_globals(Globals { root: Some("/run/x".into()), systemd_cgroup: false });
        assert_eq!(other.globals().root.as_deref(), Some(Path::new("/run/x")));
        assert_eq!(other.crun().unwrap(), Path::new("/bin/sh"));
    }
}
