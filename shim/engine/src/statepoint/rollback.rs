//! `planarian rollback CTR STATEPOINT`: the container returns to a statepoint, under the same ID,
//! and Podman sees it running.
//!
//! exclusive lock → a safety statepoint of the current state (processes killed while frozen) →
//! remote state compensated → the files of the statepoint put in place (the previous ones kept
//! aside) → `podman container restore`, which calls `planarian restore` through conmon. If any
//! step fails, the container is brought back to exactly where it was: the previous files and the
//! safety statepoint.

use super::podman_dir::{leave_for_podman, Destination, Handoff};
use super::snapshot::{self, SnapshotRequest};
use super::{describe, Ctx, Error, Result};
use crate::config::Config;
use crate::context::{self, Compensated, RestoreContext, Restored};
use crate::log::Progress;
use crate::runtime::podman::{self, PodmanContainer};
use crate::runtime::Globals;
use crate::store::{Actor, ContainerStore, Manifest, Outcome, OutcomeStatus};
use std::fs::File;
use std::time::Duration;

/// A rollback about to run: the container, its store (locked exclusively until this is dropped)
/// and the statepoint it returns to.
pub struct Rollback {
    pub container: PodmanContainer,
    pub target: Manifest,
    store: ContainerStore,
    cfg: Config,
    _lock: File,
}

impl Rollback {
    /// Finds container `name` and its committed statepoint `statepoint` (id or name), and takes
    /// the container's exclusive lock: waiting for it, or, with `wait` false, refusing when
    /// another operation (a snapshot, a rollback, a tool call) holds it.
    pub fn begin(name: &str, statepoint: &str, wait: bool) -> Result<Rollback> {
        let container = podman::planarian_container(name)?;
        let cfg = Config::load()?;
        let store = ContainerStore::new(&cfg.store.path, &container.id);
        let lock = match wait {
            true => store.lock(true)?,
            false => store.try_lock(true)?.ok_or_else(|| Error::Busy(container.name.clone()))?,
        };
        let target = store.find(statepoint)?;
        Ok(Rollback { container, target, store, cfg, _lock: lock })
    }

    /// `rolling agent back to sp3 (deps-installed)`.
    pub fn title(&self) -> String {
        format!("rolling {} back to {}", self.container.name, describe(&self.target))
    }

    /// Runs it, reporting each phase to `progress`. The target gets an `abandoned` outcome
    /// naming what was left (by `by`, for `reason`), and the restore context is kept in the
    /// store and returned.
    pub fn run(self, globals: &Globals, progress: &mut dyn Progress, reason: Option<&str>, by: Actor) -> Result<RestoreContext> {
        let (store, target) = (&self.store, &self.target);
        let left = context::left_behind(&store.manifests(), store.head().as_deref(), &target.statepoint_id);
        let done = rollback(globals, &self.cfg, &self.container, store, target, progress)?;
        let compensated: Vec<Compensated> = target
            .remote_state
            .iter()
            .filter_map(|r| {
                let from = done.safety_positions.iter().find(|s| s.hook_path == r.hook_path).and_then(|s| s.mcp_call_position);
                Some(Compensated { endpoint: r.external_endpoint.clone(), from_position: from, to_position: r.mcp_call_position? })
            })
            .collect();
        let calls: u64 = compensated.iter().filter_map(|c| Some(c.from_position?.saturating_sub(c.to_position))).sum();
        let mut what = vec![match &done.from {
            Some(from) => format!("rolled back here from the state after {from}"),
            None => "rolled back here".to_string(),
        }];
        if !left.is_empty() {
            what.push(format!("left {}", left.join(", ")));
        }
        if calls > 0 {
            what.push(format!("undid {calls} MCP call{}", if calls == 1 { "" } else { "s" }));
        }
        if let Some(r) = reason {
            what.push(format!("reason: {r}"));
        }
        let ctx = RestoreContext {
            operation: "rollback".into(),
            container: self.container.name.clone(),
            statepoint: Restored {
                id: target.statepoint_id.clone(),
                name: target.name.clone(),
                description: target.state_evidence.state_description.clone(),
                state: target.state_evidence.state.clone(),
                source: None,
            },
            restored: vec!["processes and memory (CRIU restore)".into(), format!("files ({})", done.files_backend)],
            compensated,
            discarded_statepoints: left,
            reason: reason.map(String::from),
            prior_outcomes: target.state_evidence.prior_outcomes.clone(),
            time: crate::log::rfc3339(std::time::SystemTime::now()),
        };
        // Evidence after the fact: the rollback itself succeeded whatever these do.
        let _ = context::append_outcome(store, &target.statepoint_id, Outcome::now(what.join("; "), OutcomeStatus::Abandoned, by, None));
        let _ = ctx.save(store);
        Ok(ctx)
    }
}

/// What a rollback that succeeded knows for its restore context.
struct Done {
    /// The head it left (the statepoint the sandbox had continued from).
    from: Option<String>,
    /// Remote positions just before the rollback (from the safety statepoint).
    safety_positions: Vec<crate::store::RemoteState>,
    files_backend: &'static str,
}

fn rollback(globals: &Globals, cfg: &Config, pc: &PodmanContainer, store: &ContainerStore, target: &Manifest, progress: &mut dyn Progress) -> Result<Done> {
    let from = store.head();
    let rootfs = crate::local::rootfs_for(cfg, store, &pc.id, pc.upperdir.clone())?;
    if rootfs.backend() != target.local_state.rootfs_backend {
        return Err(Error::BackendChanged {
            statepoint: target.statepoint_id.clone(),
            then: target.local_state.rootfs_backend.clone(),
            now: rootfs.backend().to_string(),
        });
    }
    let saved = store.statepoint_dir(&target.statepoint_id);
    crate::local::zfs::check_rollback(cfg, store, &target.local_state)?;
    if let Some(copy) = &target.local_state.rootfs_copy_path {
        if !saved.join(copy).exists() {
            return Err(Error::FilesMissing { statepoint: target.statepoint_id.clone(), path: saved.join(copy) });
        }
    }

    // The sidecar outlives the stop and restore of a rollback: the agent's MCP connection stays
    // up, and compensation needs it.
    let _rolling = crate::remote::sidecar::RollbackMarker::set(store);

    // 1. Keep the current state until the restore succeeded.
    let safety = match pc.status.as_str() {
        "running" | "paused" => {
            progress.phase("safety statepoint of the current state");
            let ctx = Ctx::load(globals, &pc.id)?;
            ctx.recover();
            let m = snapshot::take(
                &ctx,
                &SnapshotRequest {
                    tcp_established: target.options.tcp_established,
                    file_locks: target.options.file_locks,
                    leave_running: false,
                    internal: true,
                    name: None,
                    description: Some(format!("before rollback to {}", target.statepoint_id)),
                    state: None,
                    id: None,
                },
            )?;
            podman::wait_stopped(&pc.id, pc.upperdir.as_deref(), Duration::from_secs(60))?;
            progress.done(&m.statepoint_id);
            Some(m)
        }
        _ => None,
    };

    // 2. Remote state first (the sandbox is stopped, nothing calls out), then files, processes.
    if !target.remote_state.is_empty() {
        progress.phase("remote state compensated");
    }
    let result = (|| -> Result<()> {
        crate::fault::point("rollback.stopped")?;
        crate::remote::hooks::compensate(&target.remote_state, &pc.id)?;
        progress.phase(&format!("files ({})", rootfs.backend()));
        let files = rootfs.restore(&saved, &target.local_state)?;
        progress.phase("processes (podman container restore)");
        let restored = crate::fault::point("rollback.files-restored").map_err(Error::from).and_then(|()| podman_restore(store, pc, target));
        match restored {
            Ok(stats) => {
                files.commit();
                if let Some(s) = stats {
                    progress.done(&s.breakdown());
                }
                Ok(())
            }
            Err(e) => match files.undo() {
                Ok(()) => Err(e),
                Err(u) => Err(Error::UndoFailed { first: Box::new(e), undoing: "putting the previous files back", then: Box::new(u.into()) }),
            },
        }
    })();

    let files_backend = rootfs.backend();
    match (result, safety) {
        (Ok(()), Some(s)) => {
            let _ = super::remove(cfg, store, &s.statepoint_id);
            Ok(Done { from, safety_positions: s.remote_state, files_backend })
        }
        (Ok(()), None) => Ok(Done { from, safety_positions: vec![], files_backend }),
        (Err(e), Some(s)) => {
            // 3. Back to where it was.
            progress.phase(&format!("back to the safety statepoint {}", s.statepoint_id));
            let back = podman_restore(store, pc, &s).map(drop);
            if back.is_ok() {
                progress.done("");
            }
            let _ = super::remove(cfg, store, &s.statepoint_id);
            match back {
                Ok(()) => Err(Error::RolledBack(Box::new(e))),
                Err(b) => Err(Error::NotRolledBack { first: Box::new(e), then: Box::new(b) }),
            }
        }
        (Err(e), None) => Err(Error::RolledBack(Box::new(e))),
    }
}

/// Asks Podman to restore the container from statepoint `m`, handing our lock to the restore;
/// what Podman says of the restore's time, when it says.
fn podman_restore(store: &ContainerStore, pc: &PodmanContainer, m: &Manifest) -> Result<Option<podman::RestoreStats>> {
    let image_path = pc.bundle.join("checkpoint");
    let _ = std::fs::remove_dir_all(&image_path);
    leave_for_podman(m, &store.statepoint_dir(&m.statepoint_id), &image_path, None, Destination::Stays)?;
    let handoff = Handoff::give(store, &pc.id)?;
    let mut args = vec!["container", "restore", "--print-stats"];
    if m.options.tcp_established {
        args.push("--tcp-established");
    }
    args.push(&pc.id);
    let r = podman::output(&args);
    drop(handoff);
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&image_path);
    }
    Ok(podman::RestoreStats::parse(&r?))
}
