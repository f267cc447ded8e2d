//! The engine's front door: [`Engine`], made once by a binary (the runtime verb, a command, the
//! MCP server, a background worker) and handed to every operation.
//!
//! It holds what every operation needs and none looks up again: the configuration (read once,
//! each container's annotations applied on top by the operation that loads it), the runtime's
//! global flags (`--root`, `--systemd-cgroup`), and the tools it drives (crun, CRIU), each found
//! once, on first use — so a verb crun answers alone (`state`, `list`) never looks for CRIU.

use crate::config::{Config, ConfigError};
use crate::context::Ledger;
use crate::runtime::{self, Bundle, Globals};
use crate::statepoint::{
    self, fork::Fork, restore::RestoreRequest, restore::Restored, rollback::Rollback, snapshot::SnapshotRequest,
    spares::Pool, travel, travel::Exported, travel::ImportedContainer,
};
use crate::store::ContainerStore;
use crate::store::Manifest;
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

    // The operations, one shape: `engine.verb(…)`, the long ones (rollback, fork, spares)
    // returning the operation begun — found, checked, locked — whose `run` does it with progress.

    /// The registry of the container a user names (a name, an ID or a prefix).
    pub fn store_of(&self, container: &str) -> statepoint::Result<ContainerStore> {
        statepoint::store_of(&self.cfg, container)
    }

    /// A statepoint of running container `container`, taken now (the container's exclusive
    /// lock waited for, what is in flight in it said on stderr while waited for).
    pub fn snapshot(&self, container: &str, req: &SnapshotRequest) -> statepoint::Result<Manifest> {
        let (ctx, _lock) = statepoint::Ctx::running_locked(self, container)?;
        statepoint::snapshot::take(&ctx, req)
    }

    /// A statepoint of `container` taken in the background by `worker` (this binary): its ID, once
    /// the worker holds the lock ([`statepoint::async_snapshot`]).
    pub fn snapshot_async(&self, container: &str, req: &SnapshotRequest, worker: &Path) -> statepoint::Result<String> {
        statepoint::async_snapshot::start(self, container, req, worker)
    }

    /// Podman's `container checkpoint` of container `id` (full ID), into Podman's directories.
    pub fn checkpoint(
        &self,
        id: &str,
        req: &SnapshotRequest,
        image_path: Option<&Path>,
        work_path: Option<&Path>,
    ) -> statepoint::Result<Manifest> {
        statepoint::snapshot::checkpoint(self, id, req, image_path, work_path)
    }

    /// Podman's `--pre-checkpoint`: a memory pre-dump of container `id` into `image_path`.
    pub fn pre_dump(&self, id: &str, image_path: &Path) -> statepoint::Result<()> {
        statepoint::snapshot::pre_dump(self, id, image_path)
    }

    /// The runtime's `restore` verb (conmon, containerd's shim).
    pub fn restore(&self, req: &RestoreRequest) -> statepoint::Result<Restored> {
        statepoint::restore::restore(self, req)
    }

    /// A rollback of `container` to `statepoint` begun: with `wait` false, refused when
    /// another operation holds the container.
    pub fn rollback(&self, container: &str, statepoint: &str, wait: bool) -> statepoint::Result<Rollback> {
        Rollback::begin(self, container, statepoint, wait)
    }

    /// A fork of `container` at `statepoint` begun (into `name`, or a spare's, or the first free
    /// `CTR-fork-SP-K`); `run` makes one, `run_many` several side by side.
    pub fn fork(&self, container: &str, statepoint: &str, name: Option<&str>) -> statepoint::Result<Fork> {
        Fork::begin(self, container, statepoint, name)
    }

    /// The spares of `container`'s `statepoint` ([`statepoint::fork::keep_spares`] fills it).
    pub fn spares(&self, container: &str, statepoint: &str) -> statepoint::Result<Pool> {
        statepoint::spares::pool(self, container, statepoint)
    }

    /// Statepoint `statepoint` of `container` written into `file`, incremental since `since`.
    pub fn export(
        &self,
        container: &str,
        statepoint: &str,
        since: Option<&str>,
        file: &Path,
    ) -> statepoint::Result<(Manifest, Exported)> {
        let store = self.store_of(container)?;
        let _lock = store.lock(false)?;
        let m = store.find(statepoint)?;
        let since = since.map(|s| store.find(s)).transpose()?;
        let recipe = travel::Recipe::of(&runtime::podman::inspect_json(&store.container_id())?);
        let e = travel::export(&self.cfg, &store, &m, since.as_ref(), &recipe, file)?;
        Ok((m, e))
    }

    /// A statepoint file made into a new container (named `name`, or as the source was), its
    /// files under `parent_dataset` when on ZFS, restored and running.
    pub fn import(
        &self,
        file: &Path,
        name: Option<&str>,
        parent_dataset: Option<&str>,
    ) -> statepoint::Result<ImportedContainer> {
        travel::import_file(&self.cfg, file, name, parent_dataset)
    }

    /// Statepoints `statepoints` of `container` removed, each with its spares, `removed` told
    /// each one's ID as it goes; all found first (a bad name removes nothing).
    pub fn remove(
        &self,
        container: &str,
        statepoints: &[String],
        removed: &mut dyn FnMut(&str),
    ) -> statepoint::Result<()> {
        let store = self.store_of(container)?;
        let _lock = store.lock(true)?;
        let found: Vec<Manifest> = statepoints.iter().map(|s| store.find(s)).collect::<Result<_, _>>()?;
        for m in found {
            statepoint::remove(&self.cfg, &store, &m.statepoint_id)?;
            // (its spares, forks of it made ahead, go with it)
            let _ = statepoint::spares::remove_all(self, container, &m.statepoint_id);
            removed(&m.statepoint_id);
        }
        Ok(())
    }

    /// Statepoint `statepoint` of `container` renamed, described, or given outcomes.
    pub fn annotate(
        &self,
        container: &str,
        statepoint: &str,
        name: Option<&str>,
        description: Option<&str>,
        outcomes: Vec<crate::store::Outcome>,
    ) -> statepoint::Result<Manifest> {
        statepoint::annotate(&self.store_of(container)?, statepoint, name, description, outcomes)
    }

    /// Waits until `container`'s asynchronous snapshot `statepoint` has ended, and says how.
    pub fn wait(
        &self,
        container: &str,
        statepoint: &str,
    ) -> statepoint::Result<statepoint::async_snapshot::AsyncOutcome> {
        statepoint::async_snapshot::wait(&self.store_of(container)?, statepoint)
    }

    /// Keeps `count` spares of `pool`'s statepoint (made, or removed), reporting to `progress`.
    pub fn keep_spares(
        &self,
        pool: Pool,
        count: usize,
        progress: &mut dyn crate::log::Progress,
    ) -> statepoint::Result<Vec<statepoint::spares::Spare>> {
        statepoint::fork::keep_spares(pool, count, progress)
    }

    /// The ledger of `container`: its statepoints as a tree, with their evidence.
    pub fn ledger(&self, container: &str) -> statepoint::Result<Ledger> {
        Ok(Ledger::of(&self.store_of(container)?, container))
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
        Ok(Some(to_crun(store.lock(false)?, &store.dir)?))
    }

    /// For the runtime's `pause` and `resume` of container `id`: its freeze lock
    /// ([`local::freezer::LOCK`]), to be inherited by crun, once planarian does not hold the
    /// container frozen (a snapshot's window, a restore's settling); none without a store.
    pub fn freeze_lock(&self, id: &str) -> Result<Option<std::fs::File>, statepoint::Error> {
        let dir = self.store(id).dir;
        Ok(self.exec_freeze_lock(id)?.map(|l| to_crun(l, &dir)).transpose()?)
    }

    /// For `exec` in container `id`: its freeze lock, once planarian does not hold the container
    /// frozen (a snapshot's window, a page server's settling after a fork or a restore on
    /// demand), which crun would refuse ("is paused"). Close-on-exec: held until crun returns
    /// from conmon's `exec --detach` (the command started), or let go as crun starts, so that a
    /// `pause` during a long tool call does not wait for it (a container `podman pause` froze
    /// holds no lock: crun says it is paused, as it would). None without a store.
    pub fn exec_freeze_lock(&self, id: &str) -> Result<Option<std::fs::File>, statepoint::Error> {
        let store = self.store(id);
        if !store.dir.exists() {
            return Ok(None);
        }
        Ok(Some(crate::local::freezer::lock(&store.dir)?))
    }

    /// `exec` with conmon's process file `file`: what the tool call leaves running must be in
    /// a session CRIU can dump ([`runtime::exec`]); crun 1.20 and later give it one already. A
    /// command started with `podman exec -d` (`background`) is started by a shell of the
    /// container, in the background ([`runtime::exec::in_background`]), so that it is in the
    /// container's process tree, which statepoints capture. Says whether the command is started
    /// so (in the background).
    pub fn prepare_exec(&self, id: &str, file: &Path, background: bool) -> bool {
        let Ok(crun) = self.crun() else { return false };
        let own_session = !runtime::exec::runtime_gives_exec_a_session(crun);
        if !own_session && !background {
            return false;
        }
        let Ok(pid) = runtime::Container::load(crun, &self.globals, id).and_then(|c| c.running_pid()) else {
            return false;
        };
        let in_background = background
            && runtime::exec::rewrite_process_file(file, |p| runtime::exec::in_background(p, pid, own_session));
        // (a detached command the container's shell cannot start still gets its own session
        // where crun gives none: without one, CRIU refuses every later statepoint)
        if !in_background && own_session {
            runtime::exec::rewrite_process_file(file, |p| runtime::exec::in_own_session(p, pid));
        }
        in_background
    }

    /// Whether `caller`, the runtime's parent, is conmon running an exec session no client is
    /// attached to (`podman exec -d`; [`runtime::inflight::client_attached`]).
    pub fn exec_detached_by(&self, caller: i32) -> bool {
        runtime::inflight::client_attached(caller) == Some(false)
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

/// Lock `f` (of the store at `dir`) kept open across exec: crun, which replaces the runtime's
/// process, holds it until it exits.
fn to_crun(f: std::fs::File, dir: &Path) -> Result<std::fs::File, sys::IoError> {
    nix::fcntl::fcntl(&f, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
        .map_err(|e| sys::IoError::new("pass to crun the lock", dir, e.into()))?;
    Ok(f)
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
