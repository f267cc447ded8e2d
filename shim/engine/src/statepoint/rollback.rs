//! `planarian rollback CTR STATEPOINT`: the container returns to a statepoint, under the same ID,
//! and Podman sees it running.
//!
//! exclusive lock → a safety statepoint of the current state (processes killed while frozen) →
//! the files of the statepoint put in place (the previous ones kept aside) → `podman container
//! restore`, which calls `planarian restore` through conmon → remote state compensated, last:
//! it cannot be taken back, so every step that can fail comes before it. If any step fails, the
//! container is brought back to exactly where it was (the previous files and the safety
//! statepoint) and its remote state was not touched (a compensation that fails changes nothing
//! of PostgreSQL; one that undid some declared tools' calls before failing says how far).
//!
//! A rollback in place ([`in_place`]) takes no safety statepoint: it changes nothing before the
//! compensation, its first change, and after it goes forward — to the target, by a restore
//! when writing in place fails.

use super::journal::{Journal, Phase};
use super::podman_dir::podman_restore;
use super::snapshot::{self, SnapshotRequest};
use super::{describe, Ctx, Error, Result};
use crate::config::Config;
use crate::context::{self, Compensated, How, RestoreContext, Restored};
use crate::engine::Engine;
use crate::local::files::{InPlaceAt, Rootfs};
use crate::local::freezer::{FreezeGuard, Freezer};
use crate::local::inplace::{self, ahead::Ahead};
use crate::log::Progress;
use crate::runtime::podman::{self, PodmanContainer};
use crate::store::{Actor, ContainerStore, Manifest, Outcome, OutcomeStatus};
use planarian_contracts::worker;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A rollback about to run: the container, its store (locked exclusively until this is dropped)
/// and the statepoint it returns to.
pub struct Rollback {
    pub container: PodmanContainer,
    pub target: Manifest,
    store: ContainerStore,
    engine: Engine,
    /// What finding the container loaded, for the rollback in place (checked current first).
    ctx: Option<Ctx>,
    _lock: File,
}

impl Rollback {
    /// Finds container `name` and its committed statepoint `statepoint` (id or name), and takes
    /// the container's exclusive lock: waiting for it, or, with `wait` false, refusing when
    /// another operation (a snapshot, a rollback, a tool call) holds it.
    pub fn begin(engine: &Engine, name: &str, statepoint: &str, wait: bool) -> Result<Rollback> {
        crate::log::start_marks();
        let (container, ctx) = super::planarian_container_loaded(engine, name)?;
        crate::log::mark("found");
        let cfg = engine.config();
        let store = engine.store(&container.id);
        let lock = match wait {
            true => store.lock_for_statepoint(cfg.checkpoint.in_flight_wait(), &mut |what| {
                eprintln!("waiting for what is in flight in {} ({what})", container.name)
            })?,
            false => store.try_lock(true)?.ok_or_else(|| Error::Busy(container.name.clone()))?,
        };
        crate::log::mark("locked");
        // (a rollback killed half-way is finished or undone first, whatever the state)
        let (container, ctx) =
            match super::journal::recover(engine.crun(), engine.globals(), cfg, &store, &container.id)? {
                Some(_) => (podman::planarian_container(&container.id)?, None),
                None => (container, ctx),
            };
        super::finish_compensation(&store, &container.id);
        let target = store.find(statepoint)?;
        if let Some(why) = &target.unreachable {
            return Err(Error::Unreachable { statepoint: target.statepoint_id.clone(), why: why.clone() });
        }
        crate::log::mark("statepoint");
        Ok(Rollback { container, target, store, engine: engine.clone(), ctx, _lock: lock })
    }

    /// `rolling agent back to sp3 (deps-installed)`.
    pub fn title(&self) -> String {
        format!("rolling {} back to {}", self.container.name, describe(&self.target))
    }

    /// Runs it, reporting each phase to `progress`. The target gets an `abandoned` outcome
    /// naming what was left (by `by`, for `reason`), and the restore context is kept in the
    /// store and returned.
    pub fn run(mut self, progress: &mut dyn Progress, reason: Option<&str>, by: Actor) -> Result<RestoreContext> {
        let loaded = self.ctx.take();
        let (store, target) = (&self.store, &self.target);
        let left = context::left_behind(&store.summaries(), store.head().as_deref(), &target.statepoint_id);
        let done = rollback(&self.engine, &self.container, loaded, store, target, progress)?;
        crate::log::mark("rolled back");
        let compensated = compensated(target, &done);
        let calls: u64 = compensated.iter().filter_map(|c| Some(c.from_position?.saturating_sub(c.to_position))).sum();
        // Statepoints holding remote calls that the compensation undid can no longer be restored.
        let gone = context::mark_unreachable(store, target);
        let (left, unreachable): (Vec<String>, Vec<String>) = left.into_iter().partition(|id| !gone.contains(id));
        let what = what_happened(&done, &left, calls, reason);
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
            restored: restored_parts(&done),
            compensated,
            discarded_statepoints: left,
            unreachable_statepoints: unreachable,
            uncovered: context::not_undone(target, &done.safety_positions),
            not_held: context::not_held(target).collect(),
            reason: reason.map(String::from),
            prior_outcomes: target.state_evidence.prior_outcomes.clone(),
            time: crate::log::rfc3339(std::time::SystemTime::now()),
            how: Some(done.how.clone()),
        };
        // Evidence after the fact: the rollback itself succeeded whatever these do.
        let _ = context::append_outcome(
            store,
            &target.statepoint_id,
            Outcome::now(what, OutcomeStatus::Abandoned, by, None),
        );
        crate::log::mark("outcome");
        // Which path it took, in the manifest (the outcome is what a model reads: kept to what
        // happened to the sandbox).
        if let Ok(mut m) = store.find(&target.statepoint_id) {
            m.rollbacks.push(done.how.clone());
            let _ = store.write_manifest(&m);
        }
        let _ = ctx.save(store);
        crate::log::mark("recorded");
        if let Some(l) = done.leftover {
            progress.phase("in place: the files' comparison removed in the background (the sandbox runs)");
            l.remove_after(self.engine.config(), store, &self._lock);
            crate::log::mark("worker");
        }
        // Every caller's rollback (the CLI, the MCP tools) logs where its time went.
        crate::log::log_marks("rollback timeline (ms)");
        Ok(ctx)
    }
}

/// The remote state a rollback compensated: each endpoint, from where it was (the safety
/// statepoint's position) to the target's.
fn compensated(target: &Manifest, done: &Done) -> Vec<Compensated> {
    target
        .remote_state
        .iter()
        .filter_map(|r| {
            let from =
                done.safety_positions.iter().find(|s| s.hook_path == r.hook_path).and_then(|s| s.mcp_call_position);
            Some(Compensated {
                endpoint: r.external_endpoint.clone(),
                from_position: from,
                to_position: r.mcp_call_position?,
            })
        })
        .collect()
}

/// The target's `abandoned` outcome: where the rollback came from, what it left, how many MCP
/// calls it undid, and why.
fn what_happened(done: &Done, left: &[String], calls: u64, reason: Option<&str>) -> String {
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
    what.join("; ")
}

/// What the rollback put back, as the restore context says it.
fn restored_parts(done: &Done) -> Vec<String> {
    match done.how.pages_written {
        Some(p) => vec![
            format!("processes and memory (in place: {p} pages written{})", ended(&done.how.processes_ended)),
            format!("files ({}, in place)", done.files_backend),
        ],
        None => vec!["processes and memory (CRIU restore)".into(), format!("files ({})", done.files_backend)],
    }
}

/// The processes a rollback in place ended, as its progress and restore context say them
/// (`; ended, …`), or nothing.
fn ended(processes: &[String]) -> String {
    match processes {
        [] => String::new(),
        e => format!("; ended, as the statepoint does not have them: {}", e.join(", ")),
    }
}

/// What a rollback that succeeded knows for its restore context.
struct Done {
    /// The head it left (the statepoint the sandbox had continued from).
    from: Option<String>,
    /// Remote positions just before the rollback (from the safety statepoint, or asked in place).
    safety_positions: Vec<crate::store::RemoteState>,
    files_backend: &'static str,
    how: How,
    /// What a rollback in place leaves to remove.
    leftover: Option<Leftover>,
}

/// What a rollback in place leaves once the sandbox runs again: its safety statepoint
/// (discarded) and, on ZFS, the statepoint's view the files were compared with (a mount, or a
/// clone on zfs-fuse) and the snapshot of the frozen state they were found in. Removing them (a
/// `zfs destroy` and more, the images) is no part of the rollback the caller waits for: a worker
/// does it, holding the container's lock shared — tool calls go on, the next statepoint
/// operation waits for it.
struct Leftover {
    safety: String,
    zfs: Vec<String>,
}

impl Leftover {
    /// Hands the removal to a worker (`planarian __rollback-cleanup`) that inherits `lock`; done
    /// here when no worker starts.
    fn remove_after(self, cfg: &Config, store: &ContainerStore, lock: &File) {
        let spec =
            worker::Cleanup { container: store.container_id(), safety: self.safety.clone(), zfs: self.zfs.clone() };
        let spec = serde_json::to_string(&spec).expect("a worker spec serialises");
        let started = std::env::current_exe()
            .map_err(|e| Error::Worker(e.to_string()))
            .and_then(|exe| super::async_snapshot::spawn_worker(&exe, "__rollback-cleanup", lock, &spec));
        if started.is_err() {
            self.remove_now(cfg, store);
        }
    }

    fn remove_now(self, cfg: &Config, store: &ContainerStore) {
        if let (false, Ok(zfs)) = (self.zfs.is_empty(), crate::local::zfs::zfs_from(cfg)) {
            self.zfs.iter().for_each(|m| crate::local::zfs::remove_leftover(&zfs, m));
        }
        if self.safety.is_empty() {
            return;
        }
        // (discarded already: `find` knows only committed statepoints)
        let discarded = crate::store::read_manifest(&store.statepoint_dir(&self.safety).join("manifest.json"));
        if let Some(m) = discarded.ok().filter(|m| m.status == crate::store::Status::Discarded) {
            let _ = super::free(cfg, store, &m);
        }
    }
}

/// The worker of [`Leftover::remove_after`]: holds the lock it inherited (fd `lock_fd`), shared,
/// until the leftovers are removed.
pub fn cleanup_worker(engine: &Engine, lock_fd: i32, spec: &str) -> Result<()> {
    // SAFETY: the fd was inherited locked from `remove_after`; owning it keeps the lock until we exit.
    let lock: File = unsafe { std::os::fd::FromRawFd::from_raw_fd(lock_fd) };
    let _ = lock.lock_shared();
    let spec: worker::Cleanup = worker::parse(spec).map_err(Error::Worker)?;
    let store = engine.store(&spec.container);
    Leftover { safety: spec.safety, zfs: spec.zfs }.remove_now(engine.config(), &store);
    Ok(())
}

fn rollback(
    engine: &Engine,
    pc: &PodmanContainer,
    loaded: Option<Ctx>,
    store: &ContainerStore,
    target: &Manifest,
    progress: &mut dyn Progress,
) -> Result<Done> {
    let cfg = engine.config();
    let from = store.head();
    let (rootfs, mut full_path) = checked(cfg, pc, store, target)?;
    crate::log::mark("checked");
    let mut rb = Parts { engine, cfg, pc, loaded, store, target, rootfs, journal: None, intent: None };
    // The sidecar outlives the stop and restore of a rollback: the agent's MCP connection stays
    // up, and compensation needs it.
    let _rolling = crate::remote::sidecar::RollbackMarker::set(store);
    // (reserved: the lock is held; a stopped container has no safety statepoint)
    let safety_id = match pc.status.as_str() {
        "running" | "paused" => store.next_id(),
        _ => String::new(),
    };

    // A sandbox restored on demand is compared and dumped once its memory is all there (one whose
    // memory was lost is stopped already: it is restored).
    match crate::local::lazy::settled(store) {
        Ok(()) | Err(crate::local::lazy::Error::Lost(_)) => {}
        Err(e) => return Err(crate::local::Error::from(e).into()),
    }
    crate::log::mark("settled");
    // 0. In place, when the tree has the statepoint's shape.
    let not_in_place = match pc.status.as_str() {
        "running" => match try_in_place(&mut rb, &safety_id, &mut full_path, progress)? {
            InPlace::Done { how, positions, leftover } => {
                return Ok(Done {
                    from,
                    safety_positions: positions,
                    files_backend: rb.rootfs.backend(),
                    how: *how,
                    leftover,
                })
            }
            InPlace::Refused(why) => Some(why),
        },
        _ => None,
    };
    if pc.cri {
        // (nothing was changed: a refusal in place comes before any write)
        let why = not_in_place.unwrap_or_default();
        return Err(Error::NotPodmans {
            name: pc.id.clone(),
            what: format!("it cannot be rolled back in place ({why}), and {NOT_BY_RESTORE}; nothing was changed"),
        });
    }
    full_path.into_inner()?;
    let how = How { path: "stop-and-restore".into(), not_in_place, ..How::default() };
    // 1. Keep the current state until the restore succeeded.
    let safety = take_safety(&rb, &safety_id, progress)?;
    // 2. Files, processes, and the remote state last.
    let result = restore_target(&mut rb, false, progress);
    // 3. Done, or back to where it was.
    let files_backend = rb.rootfs.backend();
    match (result, safety) {
        (Ok(()), Some(s)) => {
            let _ = super::remove(cfg, store, &s.statepoint_id);
            Ok(Done { from, safety_positions: s.remote_state, files_backend, how, leftover: None })
        }
        (Ok(()), None) => Ok(Done { from, safety_positions: vec![], files_backend, how, leftover: None }),
        (Err(e), Some(s)) => Err(back_to_safety(&mut rb, e, &s, progress)),
        (Err(e), None) => Err(rolled_back(e)),
    }
}

/// Why a container a CRI engine runs is not rolled back by stopping and restoring it.
const NOT_BY_RESTORE: &str = "a rollback that stops and restores goes through Podman, which does not run it";

/// One rollback's parts, shared by its phases.
struct Parts<'a> {
    engine: &'a Engine,
    cfg: &'a Config,
    pc: &'a PodmanContainer,
    /// The container's context as finding it loaded, before the lock (taken by the first use).
    loaded: Option<Ctx>,
    store: &'a ContainerStore,
    target: &'a Manifest,
    rootfs: Box<dyn Rootfs>,
    /// Kept from the first change of a running sandbox on: a planarian killed half-way leaves
    /// a sandbox the next operation finishes or undoes (see [`super::journal`]).
    journal: Option<Journal>,
    /// A rollback in place's compensation, done, until the sandbox is at the target too.
    intent: Option<crate::remote::hooks::Intent>,
}

/// Whether the stop-and-restore path can run, asked beside the rollback (or when wanted).
type FullPath = Beside<Result<(), crate::local::Error>>;

/// What a rollback needs before it starts: the container's files where the statepoint's were
/// (the same backend, the statepoint's copy there), and — asked beside the rollback, waited for
/// only where it matters — whether stopping and restoring is possible (the statepoint's snapshot
/// gone, or on zfs-fuse clones of the dataset in use, refuse it; a rollback in place does not
/// swap datasets and goes ahead). On zfs-fuse that is `zfs list`s, a few hundred ms of CPU: asked
/// only when wanted, not beside every rollback in place.
fn checked(
    cfg: &Config,
    pc: &PodmanContainer,
    store: &ContainerStore,
    target: &Manifest,
) -> Result<(Box<dyn Rootfs>, FullPath)> {
    let rootfs = crate::local::rootfs_for(cfg, store, &pc.id, pc.upperdir.clone())?;
    crate::log::mark("rootfs");
    if rootfs.backend() != target.local_state.rootfs_backend {
        return Err(Error::BackendChanged {
            statepoint: target.statepoint_id.clone(),
            then: target.local_state.rootfs_backend.clone(),
            now: rootfs.backend().to_string(),
        });
    }
    let saved = store.statepoint_dir(&target.statepoint_id);
    let costly = crate::local::zfs::check_rollback_costly(store);
    let full_path = {
        let (cfg, store, local) = (cfg.clone(), store.clone(), target.local_state.clone());
        let check = move || crate::local::zfs::check_rollback(&cfg, &store, &local);
        // (zfs-fuse's check is `zfs` processes, which would share the CPUs with a rollback in
        // place: asked only when wanted, by a refusal or a stop and restore)
        match costly {
            true => Beside::later(check),
            false => Beside::start(check),
        }
    };
    if let Some(copy) = &target.local_state.rootfs_copy_path {
        if !saved.join(copy).exists() {
            return Err(Error::FilesMissing { statepoint: target.statepoint_id.clone(), path: saved.join(copy) });
        }
    }
    Ok((rootfs, full_path))
}

/// Phase 0: the journal begun, then in place unless turned off.
fn try_in_place(
    rb: &mut Parts,
    safety_id: &str,
    full_path: &mut FullPath,
    progress: &mut dyn Progress,
) -> Result<InPlace> {
    // (loaded once: what finding the container loaded, if its init is the same since)
    let mut ctx = match rb.loaded.take() {
        Some(ctx) => ctx.current(rb.engine)?,
        None => Ctx::load(rb.engine, &rb.pc.id)?,
    };
    crate::log::mark("loaded");
    ctx.recover()?;
    crate::log::mark("ctx");
    rb.journal = Some(Journal::begin(rb.store, &rb.target.statepoint_id, safety_id, ctx.ctr.running_pid()?)?);
    if !ctx.cfg.checkpoint.rollback_in_place {
        return Ok(InPlace::Refused("turned off (checkpoint.rollback_in_place = false)".into()));
    }
    let pod = rb.pc.cri.then(|| NOT_BY_RESTORE.to_string());
    // (why not, asked and waited for; or, `wait` false, waited for only where it was asked
    // beside the rollback: a question asked only when wanted is not asked, and is a reason)
    let mut blocked = |wait: bool| {
        pod.clone().or_else(|| match wait {
            true => full_path.get().as_ref().err().map(|e| e.to_string()),
            false => match full_path.started() {
                Some(r) => r.as_ref().err().map(|e| e.to_string()),
                None => Some("not asked beside the rollback".into()),
            },
        })
    };
    // (the statepoint's files made readable beside the freeze and the tree's check: on OpenZFS
    // its snapshot mounted, which needs nothing of the frozen state)
    let prepared = rb.rootfs.in_place_prepare(&rb.target.local_state, &crate::local::files::in_place_scratch(rb.store));
    let r = in_place(&ctx, rb, &mut blocked, progress, prepared)?;
    if let InPlace::Refused(why) = &r {
        progress.phase(&format!("not in place: {why}"));
    }
    Ok(r)
}

/// Phase 1: a statepoint of the current state, to come back to if the rest fails. A running
/// sandbox stays frozen until it is committed, and is then killed: a planarian killed during
/// the dump leaves it running as it was, never stopped without a statepoint of its state. (With
/// established TCP connections CRIU kills the processes itself, their sockets still in repair
/// mode: a kill from outside would close them, and the peers of the restored connections would
/// have seen them reset.)
fn take_safety(rb: &Parts, safety_id: &str, progress: &mut dyn Progress) -> Result<Option<Manifest>> {
    let (pc, store, target) = (rb.pc, rb.store, rb.target);
    let running = match pc.status.as_str() {
        "running" => !target.options.tcp_established,
        "paused" => false,
        _ => return Ok(None),
    };
    progress.phase("safety statepoint of the current state");
    let mut ctx = Ctx::load(rb.engine, &pc.id)?;
    ctx.recover()?;
    let freezer = Freezer::of_pid(ctx.ctr.running_pid()?)?;
    let frozen = match running {
        true => Some(FreezeGuard::freeze(&freezer, store.dir.join(crate::local::freezer::MARKER))?),
        false => None,
    };
    let m = snapshot::take(
        &ctx,
        &SnapshotRequest {
            tcp_established: target.options.tcp_established,
            file_locks: target.options.file_locks,
            leave_running: running,
            internal: true,
            description: Some(format!("before rollback to {}", target.statepoint_id)),
            id: Some(safety_id.to_string()),
            ..SnapshotRequest::default()
        },
    )?;
    crate::log::mark("safety dumped");
    let stopped = match frozen {
        Some(frozen) => stop_frozen(&ctx, pc, frozen),
        None => Ok(podman::wait_stopped(&pc.id, pc.upperdir.as_deref(), Duration::from_secs(60))?),
    };
    if let Err(e) = stopped {
        let _ = super::remove(rb.cfg, store, &m.statepoint_id);
        return Err(e);
    }
    crate::log::mark("stopped");
    progress.done(&m.statepoint_id);
    Ok(Some(m))
}

/// Phase 2: the statepoint's files, its processes (`podman container restore`), and the remote
/// state last: compensation cannot be taken back, so every local step that can fail comes
/// before it (their undo is the safety statepoint). The restored processes run while it
/// compensates, but their calls that change anything wait: the sidecar takes the sandbox's
/// lock, which the rollback holds. A failure leaves the container stopped on its previous files.
/// `compensated`: a rollback in place that goes forward, its remote state at the target
/// already — no compensation, and a failure leaves the statepoint's files (the journal's next
/// reader restores it again).
fn restore_target(rb: &mut Parts, compensated: bool, progress: &mut dyn Progress) -> Result<()> {
    let (pc, store, target) = (rb.pc, rb.store, rb.target);
    crate::fault::point("rollback.stopped")?;
    if let Some(j) = rb.journal.as_mut() {
        j.phase(Phase::RestoringTarget)?;
    }
    progress.phase(&format!("files ({})", rb.rootfs.backend()));
    let files = rb.rootfs.restore(&store.statepoint_dir(&target.statepoint_id), &target.local_state)?;
    crate::log::mark("files restored");
    progress.phase("processes (podman container restore)");
    let restored = crate::fault::point("rollback.files-restored")
        .map_err(Error::from)
        .and_then(|()| podman_restore(store, pc, target));
    crate::log::mark("podman restored");
    match restored {
        Ok(Some(s)) => progress.done(&s.breakdown()),
        Ok(None) => {}
        Err(e) if compensated => {
            files.commit();
            return Err(e);
        }
        Err(e) => {
            return match files.undo() {
                Ok(()) => Err(e),
                Err(u) => Err(Error::UndoFailed {
                    first: Box::new(e),
                    undoing: "putting the previous files back",
                    then: Box::new(u.into()),
                }),
            }
        }
    }
    if compensated {
        if let Some(j) = rb.journal.as_mut() {
            j.done();
        }
        files.commit();
        return Ok(());
    }
    if !target.remote_state.is_empty() {
        progress.phase("remote state compensated");
    }
    let compensated = crate::remote::hooks::Intent::write(&store.dir, &target.statepoint_id, &target.remote_state)
        .map_err(Error::from)
        .and_then(|intent| {
            crate::fault::point("rollback.restored")?;
            crate::remote::hooks::compensate(&target.remote_state, &pc.id)?;
            // (before the intent goes: a kill between them leaves a rollback done; past the
            // compensation, nothing fails the rollback any more)
            if let Some(j) = rb.journal.as_mut() {
                j.done();
            }
            drop(intent);
            Ok(())
        });
    let Err(e) = compensated else {
        files.commit();
        return Ok(());
    };
    // The target's processes run on the target's files: stopped, and the previous files put
    // back (the safety statepoint's processes follow).
    let back = podman::kill(&pc.id)
        .and_then(|()| podman::wait_stopped(&pc.id, pc.upperdir.as_deref(), Duration::from_secs(60)))
        .map_err(Error::from)
        .and_then(|()| files.undo().map_err(Error::from));
    match back {
        Ok(()) => Err(e),
        Err(u) => Err(Error::UndoFailed {
            first: Box::new(e),
            undoing: "stopping the restored container and putting the previous files back",
            then: Box::new(u),
        }),
    }
}

/// Phase 3, when phase 2 failed with `e`: the safety statepoint `s` restored, then removed.
fn back_to_safety(rb: &mut Parts, e: Error, s: &Manifest, progress: &mut dyn Progress) -> Error {
    progress.phase(&format!("back to the safety statepoint {}", s.statepoint_id));
    if let Some(j) = rb.journal.as_mut() {
        let _ = j.phase(Phase::RestoringSafety);
    }
    match podman_restore(rb.store, rb.pc, s) {
        Ok(_) => {
            progress.done("");
            let _ = super::remove(rb.cfg, rb.store, &s.statepoint_id);
            rolled_back(e)
        }
        // (the safety statepoint and the journal stay: the next operation tries again)
        Err(b) => {
            if let Some(j) = rb.journal.take() {
                j.keep();
            }
            Error::NotRolledBack { first: Box::new(e), then: Box::new(b) }
        }
    }
}

enum InPlace {
    Done {
        how: Box<How>,
        /// Each service's position before the rollback.
        positions: Vec<crate::store::RemoteState>,
        leftover: Option<Leftover>,
    },
    /// Not in place, for this reason; nothing was changed, and the sandbox runs.
    Refused(String),
}

/// Kills the (frozen) container and waits until Podman sees it stopped, thawing it between.
fn stop_frozen(ctx: &Ctx, pc: &PodmanContainer, frozen: FreezeGuard) -> Result<()> {
    ctx.crun().kill(&ctx.ctr.id, false);
    drop(frozen);
    crate::log::mark("killed");
    Ok(podman::wait_stopped(&pc.id, pc.upperdir.as_deref(), Duration::from_secs(60))?)
}

/// The rollback in place (see [`crate::local::inplace`]): freeze → shape check (on OpenZFS the
/// files' part already under way beside it) → page plan (the pages against the base the next
/// dump would build on, from the processes' own page maps: no dump), the files compared beside
/// it → remote state compensated → files written → memory and processes written (working
/// directories after the files: one may be a directory they bring back), registers last → the
/// statepoint's images become the base of the next dump → thaw. Before the compensation any
/// doubt or failure changes nothing (a refusal sends the rollback down the stop-and-restore
/// path, which takes its safety statepoint); from the compensation on there is no way back, and
/// the rollback goes forward: a step that fails makes it stop the sandbox and restore the
/// statepoint, as the journal's next reader would ([`Phase::Forward`]). `blocked(wait)`: why the
/// stop-and-restore path cannot run, if it cannot: asked when it refuses (waiting for the
/// answer), and before pages are written ahead (beside the files' comparison: waiting only for a
/// question asked beside the rollback, one asked only when wanted is a reason).
/// (Its later phases are functions of their own: [`compensate_in_place`], [`write_in_place`], [`done_in_place`],
/// [`in_place_forward`]. This one holds the freeze's guard from its first line and hands it on.)
fn in_place(
    ctx: &Ctx,
    rb: &mut Parts,
    blocked: &mut (dyn FnMut(bool) -> Option<String> + Send),
    progress: &mut dyn Progress,
    prepared: Option<crate::local::files::InPlaceStart>,
) -> Result<InPlace> {
    let (store, target, rootfs) = (rb.store, rb.target, rb.rootfs.as_ref());
    let pid = ctx.ctr.running_pid()?;
    let freezer = Freezer::of_pid(pid)?;
    let frozen = FreezeGuard::freeze(&freezer, store.dir.join(crate::local::freezer::MARKER))?;
    crate::log::mark("frozen");
    progress.phase("in place: the process tree against the statepoint");
    let sp_dir = store.statepoint_dir(&target.statepoint_id);
    // What the files need (ZFS: a snapshot of the frozen state, what changed, where) is found
    // beside the page plan; and beside the process tree's check too, from the freeze on, where
    // the backend began before it (OpenZFS, whose files' part starts no process: elsewhere the
    // processes it starts would slow the check on the guest's CPUs as much as they began earlier).
    let mounts = sys::proc::Proc::of(pid).mounts().unwrap_or_default();
    let at = files_at(pid, &mounts, store);
    let early = prepared.is_some();
    let mut started = prepared.and_then(|p| rootfs.in_place_start(&sp_dir, &target.local_state, &at, Some(p)));
    let images = sp_dir.join(&target.local_state.criu_checkpoint_path);
    let stdio = stdio_pairs(&sp_dir, pid);
    let shape = match inplace::check(&images, freezer.dir(), &stdio) {
        Ok(s) => s,
        Err(e) => {
            // (thawed first: what the files' part began stops at its next step, is waited for
            // and removed)
            drop(frozen);
            drop(started);
            return Ok(InPlace::Refused(e.to_string()));
        }
    };
    crate::log::mark("shape");
    if !early {
        started = rootfs.in_place_start(&sp_dir, &target.local_state, &at, None);
    }
    crate::log::mark("files started");
    let base = live_base(store, pid);
    progress.phase(&format!("in place: what differs (memory, files on {})", rootfs.backend()));
    // The page plan beside the files' comparison (on OpenZFS mostly waiting: for the frozen
    // state's snapshot, then its stream). While the comparison still runs, the plan's pages that
    // can be put back as they were (their content in the base's images) are written ahead
    // (`inplace::ahead`; the journal says forward before: a planarian killed from then on leaves
    // a rollback the next operation finishes). Nothing else is written before both are done, and
    // a comparison that refuses or fails (a file it cannot put back, a pool too full for the frozen state's
    // snapshot), or a compensation that fails, puts those pages back first: nothing changed, and
    // the rollback stops and restores with a safety statepoint (or fails, as before).
    let compared = AtomicBool::new(false);
    // (a rollback killed from the first page written ahead goes forward: a restore of the target,
    // which must be known to be possible, as it is once written in place)
    let ahead_wanted = ctx.cfg.checkpoint.write_ahead;
    let mut ahead = Ahead::default();
    let mut journal = rb.journal.take();
    let (planned, compared_files) = std::thread::scope(|scope| {
        let (compared, ahead, journal, blocked) = (&compared, &mut ahead, &mut journal, &mut *blocked);
        let planning = scope.spawn(move || -> std::result::Result<inplace::Plan, String> {
            let mut plan = shape.plan(base.as_deref()).map_err(|e| e.to_string())?;
            crate::log::mark("pages planned");
            // (the answer waited for here, beside the comparison, which may end first: not
            // waited for once it has, which would hold the frozen sandbox for nothing)
            let running = || !compared.load(Ordering::Acquire);
            let wanted = ahead_wanted && plan.pages_written > 0 && running() && blocked(false).is_none() && running();
            if let Some(j) = journal.as_mut().filter(|_| wanted) {
                j.phase(Phase::Forward).map_err(|e| e.to_string())?;
                crate::fault::point("rollback.in-place.ahead").map_err(|e| e.to_string())?;
                plan.write_ahead(ahead).map_err(|e| e.to_string())?;
                crate::log::mark("pages written ahead");
                crate::fault::point("rollback.in-place.written-ahead").map_err(|e| e.to_string())?;
            }
            Ok(plan)
        });
        let files = (|| -> std::result::Result<_, String> {
            crate::fault::point("rollback.in-place.comparing").map_err(|e| e.to_string())?;
            dev_unchanged(&sp_dir, &mounts, store, pid)?;
            let files = rootfs.in_place(&sp_dir, &target.local_state, &at, started).map_err(|e| e.to_string())?;
            crate::fault::point("rollback.in-place.compared").map_err(|e| e.to_string())?;
            crate::log::mark("files compared");
            Ok(files)
        })();
        compared.store(true, Ordering::Release);
        (planning.join().unwrap_or_else(|p| std::panic::resume_unwind(p)), files)
    });
    rb.journal = journal;
    let (plan, files) = match (planned, compared_files) {
        (Ok(plan), Ok(files)) => (plan, files),
        (_, Err(why)) | (Err(why), _) => {
            if let Err(e) = put_back(&ahead, progress) {
                return Err(half_written(ctx, rb, frozen, &why, e));
            }
            // (nothing written again; a journal that cannot say so fails the rollback, the
            // sandbox thawed as before and the journal removed)
            rb.journal.as_mut().map(Journal::nothing_written).transpose()?;
            if let Some(b) = blocked(true) {
                return Err(Error::Worker(format!(
                    "cannot roll back in place ({why}), nor by stopping and restoring ({b}); nothing was changed"
                )));
            }
            // (thawed: the stop-and-restore path freezes it again for its safety statepoint)
            drop(frozen);
            return Ok(InPlace::Refused(why));
        }
    };
    let examined =
        files.sync.places.map(|n| format!(" ({n} changed objects examined where they are)")).unwrap_or_default();
    let early = match ahead.pages {
        0 => String::new(),
        n => format!(", {n} of them written while the files were compared"),
    };
    progress.done(&format!("{} pages{early}, {} files{examined}", plan.pages_written, files.sync.len()));
    // The remote state first: a compensation that fails leaves the sandbox untouched (the pages
    // written ahead put back).
    let positions = match compensate_in_place(ctx, rb, progress) {
        Ok(p) => p,
        Err(e) => {
            drop(files);
            if let Err(u) = put_back(&ahead, progress) {
                return Err(half_written(ctx, rb, frozen, &e.to_string(), u));
            }
            rb.journal = None;
            drop(frozen);
            return Err(rolled_back(e));
        }
    };
    drop(ahead);
    progress.phase("in place: files and memory written");
    match write_in_place(rb, &plan, &files, &freezer, pid) {
        Ok((a, n)) => done_in_place(ctx, rb, &plan, files, frozen, &freezer, pid, positions, a, n, progress),
        Err(e) => {
            drop(files);
            in_place_forward(ctx, rb, frozen, e, positions, progress)
        }
    }
}

/// The pages a rollback in place wrote ahead of its files' comparison put back (see
/// [`inplace::ahead`]). An error is a sandbox half-written ([`half_written`]).
fn put_back(ahead: &Ahead, progress: &mut dyn Progress) -> Result<()> {
    if !ahead.is_empty() {
        crate::fault::point("rollback.in-place.put-back")?;
        ahead.undo().map_err(|e| Error::Worker(format!("putting back the pages written ahead failed: {e}")))?;
        progress.phase(&format!("in place: the {} pages written ahead put back", ahead.pages));
        crate::log::mark("put back");
    }
    Ok(())
}

/// A rollback in place that failed (`why`) and could not put back the pages it wrote ahead
/// (`e`): the sandbox is stopped while frozen (nothing half-written runs) and the journal, which
/// says forward, kept: the next operation on the container restores the statepoint and
/// compensates the services to it.
fn half_written(ctx: &Ctx, rb: &mut Parts, frozen: FreezeGuard, why: &str, e: Error) -> Error {
    let stopped = stop_frozen(ctx, rb.pc, frozen);
    if let Some(j) = rb.journal.take() {
        j.keep();
    }
    let stopped = match stopped {
        Ok(()) => "the sandbox is stopped".to_string(),
        Err(s) => format!("stopping the sandbox failed too ({s})"),
    };
    Error::Worker(format!(
        "rollback in place failed ({why}), and {e}; {stopped}, and the next planarian operation on it finishes the rollback"
    ))
}

/// The base the next dump of the tree whose init is `pid` would build on, when there is one.
fn live_base(store: &ContainerStore, pid: i32) -> Option<PathBuf> {
    let base = crate::chain::read_base(store)?;
    let init_start = sys::proc::start_time(pid)?;
    (base.init_start_time == init_start).then_some(())?;
    base.images.map(|i| store.dir.join(i)).filter(|d| d.join("inventory.img").exists())
}

/// The remote state of a rollback in place, the sandbox frozen and nothing of it written yet:
/// each service's position now (for the restore context), then the compensation to the
/// target's, under its intent. From here the journal says [`Phase::Forward`]: a planarian
/// killed from now on leaves a rollback the next operation finishes. Returns the positions it
/// came from; an error when the compensation failed (a failed compensation changes nothing of
/// PostgreSQL; one that undid some declared tools' calls before failing says how far): nothing
/// of the sandbox is written then but the pages written ahead, which the caller puts back.
fn compensate_in_place(
    ctx: &Ctx,
    rb: &mut Parts,
    progress: &mut dyn Progress,
) -> Result<Vec<crate::store::RemoteState>> {
    let (pc, store, target) = (rb.pc, rb.store, rb.target);
    let journal = rb.journal.as_mut().expect("begun before a rollback in place");
    let mut positions = Vec::new();
    if !target.remote_state.is_empty() {
        progress.phase("remote state compensated");
        let parent = store.head().and_then(|h| store.find(&h).ok()).map(|m| m.remote_state).unwrap_or_default();
        positions = crate::remote::hooks::capture(&crate::remote::sidecar::remote_hooks(&ctx.cfg)?, &pc.id, &parent)?;
    }
    journal.phase(Phase::Forward)?;
    let compensated = (!target.remote_state.is_empty())
        .then(|| crate::remote::hooks::Intent::write(&store.dir, &target.statepoint_id, &target.remote_state))
        .transpose()
        .map_err(Error::from)
        .and_then(|intent| {
            crate::fault::point("rollback.in-place.compensating")?;
            crate::remote::hooks::compensate(&target.remote_state, &pc.id)?;
            // (kept until the journal says done: a kill before then finishes the compensation
            // first, and a finished one again is nothing)
            Ok(intent)
        });
    // (on an error the journal, forward now, is the caller's to remove: pages written ahead are
    // put back first)
    rb.intent = compensated?;
    Ok(positions)
}

/// The writing phase of a rollback in place, the sandbox frozen and its remote state at the
/// target: files, then memory and processes (a working directory may be a directory the files
/// bring back). Returns what was applied and how many files changed.
fn write_in_place(
    rb: &mut Parts,
    plan: &inplace::Plan,
    files: &crate::local::files::InPlaceFiles,
    freezer: &Freezer,
    pid: i32,
) -> Result<(inplace::Applied, usize)> {
    let store = rb.store;
    crate::fault::point("rollback.in-place.files")?;
    let n = files.apply()?;
    crate::log::mark("files written");
    // (the memory's soft-dirty bits are cleared against the statepoint's pages: until its images
    // are recorded as the base, no dump or plan may build on the current one)
    let init_start = sys::proc::start_time(pid).unwrap_or(0);
    let why = "a rollback in place was interrupted while it wrote memory";
    crate::chain::write_base(store, &crate::chain::Base::full(init_start, why))?;
    let a = plan.apply(freezer).map_err(|e| Error::Worker(e.to_string()))?;
    crate::log::mark("written");
    crate::fault::point("rollback.in-place.written")?;
    if let Some(j) = rb.journal.as_mut() {
        j.done();
    }
    rb.intent = None;
    Ok((a, n))
}

/// A rollback in place written: the chain's base is the target's images, the head the target;
/// the sandbox thaws; what the files' comparison left is removed once the caller has its
/// answer ([`Leftover`]).
#[allow(clippy::too_many_arguments)]
fn done_in_place(
    ctx: &Ctx,
    rb: &Parts,
    plan: &inplace::Plan,
    files: crate::local::files::InPlaceFiles,
    frozen: FreezeGuard,
    freezer: &Freezer,
    pid: i32,
    positions: Vec<crate::store::RemoteState>,
    a: inplace::Applied,
    n: usize,
    progress: &mut dyn Progress,
) -> Result<InPlace> {
    let (store, target) = (rb.store, rb.target);
    if let Some(dir) = crate::fault::oracle_dir() {
        if let Err(e) = snapshot::raw_dump(ctx, pid, freezer, &dir) {
            progress.phase(&format!("oracle dump failed: {e}"));
        }
    }
    record_base(store, target, pid, plan.pids());
    if let Err(e) = store.set_head(Some(&target.statepoint_id)) {
        // (the files' leftovers go before the thaw, as everywhere else)
        drop(files);
        drop(frozen);
        return Err(e.into());
    }
    crate::log::mark("chain");
    drop(frozen);
    crate::log::mark("thawed");
    progress.done(&format!(
        "{} pages written, {} dropped, {} system calls, {n} files{}",
        a.pages_written,
        a.pages_dropped,
        a.system_calls,
        ended(&a.ended)
    ));
    let (places_examined, places_from) = (files.sync.places, files.sync.located_by);
    let zfs = files.hand_off();
    let leftover = (!zfs.is_empty()).then_some(Leftover { safety: String::new(), zfs });
    let how = How {
        path: "in-place".into(),
        pages_written: Some(a.pages_written),
        pages_dropped: Some(a.pages_dropped),
        files_changed: Some(n as u64),
        places_examined: places_examined.map(|p| p as u64),
        places_from: places_from.map(String::from),
        not_in_place: None,
        processes_ended: a.ended,
    };
    Ok(InPlace::Done { how: Box::new(how), positions, leftover })
}

/// A rollback in place that failed after its compensation (`e`) goes forward: the sandbox,
/// perhaps half-written, is stopped while frozen and the statepoint restored (files, then
/// processes through Podman), so that sandbox and services are both at the target. When that
/// fails too, the journal stays for the next operation, which tries again.
fn in_place_forward(
    ctx: &Ctx,
    rb: &mut Parts,
    frozen: FreezeGuard,
    e: Error,
    positions: Vec<crate::store::RemoteState>,
    progress: &mut dyn Progress,
) -> Result<InPlace> {
    progress.phase(&format!("in place failed ({e}): the statepoint restored instead"));
    let restored = stop_frozen(ctx, rb.pc, frozen).and_then(|()| restore_target(rb, true, progress));
    match restored {
        Ok(()) => {
            let how = How {
                path: "stop-and-restore".into(),
                not_in_place: Some(format!("writing in place failed: {e}")),
                ..How::default()
            };
            Ok(InPlace::Done { how: Box::new(how), positions, leftover: None })
        }
        Err(b) => {
            if let Some(j) = rb.journal.take() {
                j.keep();
            }
            // (and the compensation's intent: the next operation finishes both)
            if let Some(i) = rb.intent.take() {
                i.keep();
            }
            Err(Error::NotFinished { first: Box::new(e), then: Box::new(b) })
        }
    }
}

/// Where a rollback in place finds the container's files: its root through `/proc`, the
/// overlay's lower layers, its mount points (left alone), and a scratch directory.
fn files_at(pid: i32, mounts: &[sys::proc::Mount], store: &ContainerStore) -> InPlaceAt {
    InPlaceAt {
        root: sys::proc::Proc::of(pid).root(),
        lowers: crate::local::zfs::layers::overlay_layers(mounts, Path::new("/")).map(|l| l.lower).unwrap_or_default(),
        mounted: mounts
            .iter()
            .filter_map(|m| {
                Path::new(&m.point).strip_prefix("/").ok().filter(|r| !r.as_os_str().is_empty()).map(Path::to_path_buf)
            })
            .collect(),
        scratch: crate::local::files::in_place_scratch(store),
    }
}

/// /dev, a tmpfs planarian keeps itself, is put back only by a restore: in place, it must be as
/// it was at the statepoint (saved in `sp_dir`).
fn dev_unchanged(
    sp_dir: &Path,
    mounts: &[sys::proc::Mount],
    store: &ContainerStore,
    pid: i32,
) -> std::result::Result<(), String> {
    let (true, Some(dev)) = (crate::local::devfs::saved(sp_dir), crate::local::devfs::dev_mount(mounts)) else {
        return Ok(());
    };
    let then =
        crate::local::devfs::Restored::mount(sp_dir, &store.dir.join("in-place-dev")).map_err(|e| e.to_string())?;
    let live = sys::proc::Proc::of(pid).root().join("dev");
    let children: Vec<PathBuf> = dev.children.iter().map(PathBuf::from).collect();
    let differs =
        crate::local::treesync::plan(&then.path, &live, &live, &[], false, &children).map_err(|e| e.to_string())?;
    match differs.is_empty() {
        true => Ok(()),
        false => Err(format!("/dev changed since the statepoint ({} entries)", differs.len())),
    }
}

/// After a rollback in place, the next dump builds on the statepoint's images: the soft-dirty
/// bits were cleared after the writes, and E covers every thread's start (`pids`). Never an
/// incremental dump against the base the tree had before: a base that cannot be recorded makes
/// the next dump full (as the writing left it).
fn record_base(store: &ContainerStore, target: &Manifest, pid: i32, pids: &[i32]) {
    let init_start = sys::proc::start_time(pid).unwrap_or(0);
    let epoch = criu_hooks::epoch(pids)
        .ok()
        .zip(nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten())
        .map(|(e, clk)| crate::chain::Epoch::Recorded(criu_hooks::ticks_to_usec(e, clk as u64)))
        .unwrap_or_else(|| crate::chain::Epoch::Missing("no start time of the rolled-back threads".into()));
    if crate::chain::after_restore(store, target, epoch, init_start).is_err() {
        let why = "the rollback in place could not record its base";
        let _ = crate::chain::write_base(store, &crate::chain::Base::full(init_start, why));
    }
}

/// The error of a rollback whose sandbox was brought back as it was: so was its remote state,
/// unless a remote-state hook undid part of it before it failed (it says so: `partly undone:`).
fn rolled_back(e: Error) -> Error {
    match &e {
        Error::Remote(crate::remote::Error::Failed { message, .. })
            if message.contains(crate::remote::hooks::PARTLY_UNDONE) =>
        {
            Error::RemotePartly(Box::new(e))
        }
        _ => Error::RolledBack(Box::new(e)),
    }
}

/// Where fds 0–2 of the statepoint's init pointed and where they point now: Podman's pipes to
/// conmon are new after every restore, and stay the container's own.
fn stdio_pairs(sp_dir: &Path, pid: i32) -> Vec<(String, String)> {
    let then: Vec<String> = std::fs::read(sp_dir.join("descriptors.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    then.into_iter().enumerate().map(|(i, t)| (t, sys::proc::Proc::of(pid).fd_target(i as i32))).collect()
}

/// A question asked on a thread of its own beside the rollback, waited for only where its
/// answer matters.
struct Beside<T> {
    handle: Option<std::thread::JoinHandle<T>>,
    /// A question asked only when its answer is wanted, on the asker's thread.
    later: Option<Box<dyn FnOnce() -> T + Send>>,
    value: Option<T>,
}

impl<T: Send + 'static> Beside<T> {
    fn start(f: impl FnOnce() -> T + Send + 'static) -> Beside<T> {
        Beside { handle: Some(std::thread::spawn(f)), later: None, value: None }
    }

    /// Not asked beside: only when [`Beside::get`] wants the answer.
    fn later(f: impl FnOnce() -> T + Send + 'static) -> Beside<T> {
        Beside { handle: None, later: Some(Box::new(f)), value: None }
    }

    /// The answer of a question asked beside (waited for), not one asked only when wanted.
    fn started(&mut self) -> Option<&T> {
        if self.handle.is_some() {
            self.get();
        }
        self.value.as_ref()
    }

    fn get(&mut self) -> &T {
        if let Some(h) = self.handle.take() {
            self.value = Some(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        if let Some(f) = self.later.take() {
            self.value = Some(f());
        }
        self.value.as_ref().expect("answered above")
    }

    fn into_inner(mut self) -> T {
        self.get();
        self.value.take().expect("joined above")
    }
}
