//! `planarian fork CTR STATEPOINT --name NEW`: a new, independent Podman container running from a
//! statepoint of CTR, while CTR keeps running untouched.
//!
//! Podman stays in charge of the new container, so `podman ps/exec/logs/stop/rm` work on it:
//!
//! 1. `podman --runtime planarian container clone CTR NEW` copies CTR's configuration (image, command, annotations,
//!    network mode) into a new container with its own ID, writable layer and, when it runs, its
//!    own network namespace;
//! 2. NEW's OCI config, which a restore reads (a never-started container has none), is CTR's with
//!    CTR's names made NEW's ([`own_bundle`]; `podman container init` + `stop` write it where
//!    that cannot be done);
//! 3. NEW gets a statepoint of its own: the statepoint's memory images and every older image of
//!    its chain hard-linked into NEW's store (no data copied; removing CTR later breaks nothing),
//!    and its files: on ZFS NEW's dataset is a clone of the statepoint's snapshot (made before
//!    step 2; NEW's restore points its config at it), on the copy-based path they are copied
//!    into NEW's writable layer;
//! 4. `podman container restore NEW` runs `planarian restore` through conmon, exactly as for a
//!    rollback, so NEW's first snapshot is incremental on its own base.
//!
//! Any failure removes NEW and its store; CTR is never changed. A spare of the statepoint made
//! beforehand ([`super::spares`]) replaces all four steps with a thaw (and a rename).

use super::forking::{self, discard, free_record, src_config, taken, Kind, Record};
use super::podman_dir::leave_for_podman;
use super::spares;
use super::{describe, Error, Result};
use crate::config::Config;
use crate::context::{self, RestoreContext, Restored};
use crate::engine::Engine;
use crate::log::Progress;
use crate::runtime::podman::{self, PodmanContainer};
use crate::runtime::Bundle;
use crate::store::{Actor, ContainerStore, Manifest, Outcome, OutcomeStatus, Status};
use std::time::Duration;
use sys::Context;

/// A fork about to run: the source container, its store and statepoint, the new name.
pub struct Fork {
    pub source: PodmanContainer,
    pub target: Manifest,
    /// The new container's name, when one was asked for.
    pub name: Option<String>,
    pub(super) src_store: ContainerStore,
    pub(super) engine: Engine,
}

impl Fork {
    /// Finds container `name`'s committed statepoint `statepoint`; refuses a new name taken.
    /// Without `new_name`, the fork takes a spare under the spare's own name, or is made as the
    /// first free `CTR-fork-SP-K`.
    pub fn begin(engine: &Engine, container: &str, statepoint: &str, new_name: Option<&str>) -> Result<Fork> {
        let source = super::planarian_container(engine, container)?;
        if source.cri {
            return Err(Error::NotPodmans {
                name: source.id,
                what: "a fork is a Podman container cloned from it (snapshots and rollbacks in place work)".into(),
            });
        }
        let src_store = engine.store(&source.id);
        let target = src_store.find(statepoint)?;
        if let Some(why) = &target.unreachable {
            return Err(Error::Unreachable { statepoint: target.statepoint_id.clone(), why: why.clone() });
        }
        // (a fork a killed planarian left is finished or removed first: its name may be this one)
        recover(engine, &source, &src_store);
        if let Some(n) = new_name {
            super::check_container_name(n)?;
        }
        if let Some(new_name) = new_name.filter(|n| taken(n)) {
            return Err(Error::ContainerExists(new_name.to_string()));
        }
        Ok(Fork { source, target, name: new_name.map(String::from), src_store, engine: engine.clone() })
    }

    /// `forking agent at sp3 (deps-installed) into agent-b`.
    pub fn title(&self) -> String {
        format!(
            "forking {} at {} into {}",
            self.source.name,
            describe(&self.target),
            self.name.as_deref().unwrap_or("a spare or a new container")
        )
    }

    /// Runs it: the new container, running, and its restore context (kept in its store); the
    /// source statepoint gets a note naming the fork. On failure nothing is left (no container,
    /// no store).
    pub fn run(self, progress: &mut dyn Progress, by: Actor) -> Result<(PodmanContainer, RestoreContext)> {
        let job = self.plan(std::slice::from_ref(&self.name))?.remove(0);
        self.run_job(job, progress, by)
    }

    /// `names.len()` forks of the statepoint (each named, or not: a spare's name, or
    /// `CTR-fork-SP-K`), made side by side, [`parallelism`] at once, each reporting to the
    /// progress `progress_for` gives for its name. What they share is done once: the source,
    /// its statepoint, the recovery of forks a killed planarian left (in [`Fork::begin`]), the
    /// spares claimed and the names chosen. One result per fork, in order: a fork that fails
    /// leaves nothing and fails no other.
    pub fn run_many(
        self,
        names: &[Option<String>],
        progress_for: &(dyn Fn(&str) -> Box<dyn Progress + Send> + Sync),
        by: Actor,
    ) -> Result<Vec<(String, Result<Forked>)>> {
        let jobs = self.plan(names)?;
        let queue = std::sync::Mutex::new(jobs.into_iter().enumerate().collect::<std::collections::VecDeque<_>>());
        let results = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..parallelism(names.len()) {
                scope.spawn(|| loop {
                    let Some((i, job)) = queue.lock().expect("the fork queue").pop_front() else { break };
                    let name = job.name.clone();
                    let mut progress = progress_for(&name);
                    let r = self.run_job(job, progress.as_mut(), by);
                    results.lock().expect("the fork results").push((i, name, r));
                });
            }
        });
        let mut results = results.into_inner().expect("the fork results");
        results.sort_by_key(|(i, ..)| *i);
        Ok(results.into_iter().map(|(_, name, r)| (name, r)).collect())
    }

    /// Each fork's name and spare: a named one takes a spare of the statepoint too when there is
    /// one (renamed); an unnamed one keeps the spare's name, or is given the first free
    /// `CTR-fork-SP-K` none of the others has.
    fn plan(&self, names: &[Option<String>]) -> Result<Vec<Job>> {
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = names.iter().flatten().find(|n| !seen.insert(n.as_str())) {
            return Err(Error::Worker(format!("two forks cannot both be named {twice}")));
        }
        for n in names.iter().flatten() {
            super::check_container_name(n)?;
        }
        if let Some(n) = names.iter().flatten().find(|n| taken(n)) {
            return Err(Error::ContainerExists(n.clone()));
        }
        let sp = &self.target.statepoint_id;
        let mut jobs: Vec<Job> = Vec::new();
        for n in names {
            match self.job(n.as_deref(), &jobs) {
                Ok(j) => jobs.push(j),
                Err(e) => {
                    for j in jobs {
                        j.spare.iter().for_each(|s| spares::unclaim(&self.src_store, sp, s));
                    }
                    return Err(e);
                }
            }
        }
        Ok(jobs)
    }

    /// One fork's job: its record is made before a spare is claimed for it (a planarian killed
    /// in between leaves a record that puts the spare back), the spare's claimed name, or the
    /// first `CTR-fork-SP-K` that is free and none of `others` has.
    fn job(&self, name: Option<&str>, others: &[Job]) -> Result<Job> {
        let (store, sp) = (&self.src_store, self.target.statepoint_id.as_str());
        let claim = |record: &mut Record, s: &spares::Spare| -> Result<bool> {
            record.set(Kind::Claimed, &s.id)?;
            Ok(spares::unregister(store, sp, s))
        };
        if let Some(n) = name {
            let mut record = Record::begin(store, n, sp, Kind::Fork, None)?;
            for s in spares::registered(store, sp) {
                if claim(&mut record, &s)? {
                    return Ok(Job { name: n.to_string(), spare: Some(s), record });
                }
            }
            record.fork_anew()?;
            return Ok(Job { name: n.to_string(), spare: None, record });
        }
        for s in spares::registered(store, sp) {
            // (a spare another fork is claiming has its record: the next one)
            let Ok(mut record) = Record::begin(store, &s.name, sp, Kind::Fork, None) else { continue };
            if claim(&mut record, &s)? {
                return Ok(Job { name: s.name.clone(), spare: Some(s), record });
            }
        }
        let stem = format!("{}-fork-{sp}", self.source.name);
        let record = free_record(store, &stem, sp, Kind::Fork, &|n| others.iter().any(|j| j.name == n))?;
        Ok(Job { name: record.name().to_string(), spare: None, record })
    }

    /// One fork: its spare handed out, or (none, or not usable) made now.
    fn run_job(&self, job: Job, progress: &mut dyn Progress, by: Actor) -> Result<(PodmanContainer, RestoreContext)> {
        // A spare of the statepoint, restored and frozen beforehand, is handed out when there is
        // one (a rename, unless it keeps its name, and a thaw); otherwise the fork is made now.
        let Job { name, spare, mut record } = job;
        let name = name.as_str();
        let handed = match spare {
            Some(spare) => {
                record.set(Kind::HandOut, &spare.id)?;
                progress.phase(if name == spare.name {
                    "a spare of the statepoint, under its own name (thawed)"
                } else {
                    "a spare of the statepoint (podman rename, thawed)"
                });
                match spares::hand_out(&self.engine, &self.source, &spare, name) {
                    Ok(x) => Some(x),
                    Err(e) => {
                        progress.done(&format!("spare {} not usable ({e}): forking anew", spare.name));
                        record.fork_anew()?;
                        None
                    }
                }
            }
            None => None,
        };
        let (new, ctx) = match handed {
            Some(x) => x,
            None => self.make(name, &mut record, progress)?,
        };
        let name = ctx.container.as_str();
        {
            // Beside the source's tool calls: its lock shared, and the notes lock.
            let _lock = (self.src_store.lock(false), self.src_store.notes_lock());
            let note =
                Outcome::now(format!("forked into {name} ({})", super::short(&new.id)), OutcomeStatus::Info, by, None);
            let _ = context::append_outcome(&self.src_store, &self.target.statepoint_id, note);
        }
        Ok((new, ctx))
    }

    /// Makes the new container, running, and its restore context (kept in its store), noting its
    /// ID in `record` once Podman made it. On failure nothing is left (no container, no store).
    pub(super) fn make(
        &self,
        name: &str,
        record: &mut Record,
        progress: &mut dyn Progress,
    ) -> Result<(PodmanContainer, RestoreContext)> {
        let (src, cfg) = (&self.source, self.engine.config());
        // A clone gets the engine's default runtime unless told: the fork must run on planarian too.
        progress.phase("new container (podman container clone)");
        podman::clone_container(&src.runtime, &src.id, name)?;
        // (asked of Podman once: its ID, bundle and writable layer do not change below, and its
        // restore either leaves it running or fails)
        let new = podman::inspect(name).map_err(Error::from).and_then(|new| record.made(&new.id).map(|()| new));
        let new = match new
            .and_then(|new| fork_into(cfg, src, &self.src_store, &self.target, &new, progress).map(|()| new))
        {
            Ok(new) => PodmanContainer { status: "running".into(), ..new },
            Err(e) => {
                discard(cfg, src, name);
                return Err(Error::ForkFailed(Box::new(e)));
            }
        };
        let ctx = context(src, &self.target, name);
        let _ = ctx.save(&ContainerStore::new(&cfg.store.path, &new.id));
        Ok((new, ctx))
    }
}

/// The restore context of fork `name` of `src` at statepoint `target`.
pub(super) fn context(src: &PodmanContainer, target: &Manifest, name: &str) -> RestoreContext {
    RestoreContext {
        operation: "fork".into(),
        container: name.to_string(),
        statepoint: Restored {
            id: target.statepoint_id.clone(),
            name: target.name.clone(),
            description: target.state_evidence.state_description.clone(),
            state: target.state_evidence.state.clone(),
            source: Some(src.name.clone()),
        },
        restored: vec![
            "processes and memory (CRIU restore)".into(),
            if target.local_state.zfs_snapshot.is_some() {
                "files (a ZFS clone)".into()
            } else {
                "files (a copy)".into()
            },
        ],
        compensated: vec![],
        discarded_statepoints: vec![],
        unreachable_statepoints: vec![],
        uncovered: crate::context::uncovered(target),
        not_held: crate::context::not_held(target).collect(),
        reason: None,
        prior_outcomes: target.state_evidence.prior_outcomes.clone(),
        time: crate::log::rfc3339(std::time::SystemTime::now()),
        how: None,
    }
}

/// A fork made: its container, running, and its restore context.
pub type Forked = (PodmanContainer, RestoreContext);

/// One fork of [`Fork::run_many`]: its name, the spare claimed for it, and its record.
struct Job {
    name: String,
    spare: Option<spares::Spare>,
    record: Record,
}

/// How recovery left an interrupted fork.
#[derive(Debug, PartialEq, Eq)]
pub enum Recovered {
    /// It runs.
    Finished(String),
    /// Nothing of it is left.
    Undone(String),
}

impl std::fmt::Display for Recovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recovered::Finished(n) => write!(f, "an interrupted fork into {n} was finished: it runs"),
            Recovered::Undone(n) => write!(f, "an interrupted fork into {n} was undone: nothing of it is left"),
        }
    }
}

/// Finishes or undoes every fork of `src` a killed planarian left (see [`super::forking`]'s table),
/// saying which on stderr. Calls Podman: never from a verb Podman runs.
pub fn recover(engine: &Engine, src: &PodmanContainer, store: &ContainerStore) -> Vec<Recovered> {
    let mut out = Vec::new();
    for r in forking::interrupted(store) {
        let done = resolve(engine, src, store, &r);
        let _ = std::fs::remove_file(&r.path);
        eprintln!("planarian: {done}");
        out.push(done);
    }
    out
}

fn resolve(engine: &Engine, src: &PodmanContainer, store: &ContainerStore, r: &forking::Interrupted) -> Recovered {
    let cfg = engine.config();
    forking::wait_for_orphans(cfg, r, Duration::from_secs(300));
    let undone = Recovered::Undone(r.name.clone());
    let registered = |id: &str| spares::registered(store, &r.statepoint).iter().any(|s| s.id == id);
    if r.kind == Kind::Claimed {
        // Claimed, not begun: back in the registry, as it was.
        if let Some(id) = r.id.as_deref().filter(|id| !registered(id)) {
            spares::unclaim_id(cfg, store, &r.statepoint, id);
        }
        return undone;
    }
    let Some(new) = forking::found(cfg, r) else {
        // (Podman made none; what the record knew of is removed all the same)
        if let (Some(id), Kind::Fork | Kind::Spare) = (&r.id, &r.kind) {
            forking::discard_id(cfg, src, id);
        }
        return undone;
    };
    match r.kind {
        Kind::Fork if new.status == "running" => {
            let new_store = ContainerStore::new(&cfg.store.path, &new.id);
            if crate::context::RestoreContext::last(&new_store).is_none() {
                if let Ok(target) = store.find(&r.statepoint) {
                    let _ = context(src, &target, &r.name).save(&new_store);
                }
            }
            Recovered::Finished(r.name.clone())
        }
        Kind::HandOut => match spares::finish_hand_out(engine, src, &new, &r.name) {
            Ok(()) => Recovered::Finished(r.name.clone()),
            Err(_) => undone,
        },
        // Registered: whole, and maybe being handed out by another fork already.
        Kind::Spare if registered(&new.id) => Recovered::Finished(r.name.clone()),
        Kind::Spare => {
            spares::remove_id(cfg, src, &new.id);
            undone
        }
        Kind::Fork | Kind::Claimed => {
            forking::discard_id(cfg, src, &new.id);
            undone
        }
    }
}

/// Keeps `count` spares of the pool's statepoint ([`spares::fill`]), each made as a fork.
pub fn keep_spares(pool: spares::Pool, count: usize, progress: &mut dyn Progress) -> Result<Vec<spares::Spare>> {
    spares::fill(
        pool,
        count,
        &mut |pool, name, record, progress| {
            let fork = Fork::begin(&pool.engine, &pool.source.id, &pool.sp, Some(name))?;
            progress.phase(&format!("spare {name}: {}", fork.title()));
            Ok(fork.make(name, record, progress)?.0.id)
        },
        progress,
    )
}

/// How many forks run at once: as many as the machine has CPUs, at least two (a fork waits on
/// Podman and CRIU as much as it computes), at most `count`.
pub fn parallelism(count: usize) -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).max(2).min(count.max(1))
}

fn fork_into(
    cfg: &Config,
    src: &podman::PodmanContainer,
    src_store: &ContainerStore,
    target: &Manifest,
    new: &PodmanContainer,
    progress: &mut dyn Progress,
) -> Result<()> {
    let (src_cfg, name) = (src_config(cfg, src)?, new.name.as_str());
    let src_zfs = crate::local::zfs::mapping(src_store);
    if let (Some(map), Some(snap)) = (&src_zfs, &target.local_state.zfs_snapshot) {
        progress.phase("files (a ZFS clone of the statepoint)");
        // NEW's dataset exists before its first create, which points NEW's config at it.
        let store = ContainerStore::new(&cfg.store.path, &new.id);
        // Shared: tool calls on the source go on; a removal, retention or rollback waits.
        let _lock = src_store.lock(false)?;
        crate::local::zfs::fork_into(&src_cfg, map, snap, &store, &new.id, &new.bundle)?;
    }
    crate::fault::point("fork.cloned")?;
    progress.phase("its OCI bundle");
    match own_bundle(src, src_store, new)? {
        None => progress.done("the source's, made the fork's"),
        Some(why) => {
            progress.done(&format!("podman container init ({why})"));
            podman::init_stopped(name)?;
            podman::wait_stopped(&new.id, new.upperdir.as_deref(), Duration::from_secs(60))?;
        }
    }
    progress.phase("its settings (and its own database, where the service can branch)");
    let remote = carry_settings(src, &src_cfg, target, new)?;
    let store = ContainerStore::new(&cfg.store.path, &new.id);
    progress.phase("its first statepoint (images linked)");
    let m = {
        // The source's lock, shared, so that no removal or retention runs while its images are
        // linked, and tool calls on the source go on meanwhile (a fork runs beside them).
        let _lock = src_store.lock(false)?;
        let mut m = link_statepoint(src, src_store, target, &store, remote)?;
        let rootfs = crate::local::rootfs_for(&src_cfg, &store, &new.id, new.upperdir.clone())?;
        if m.local_state.zfs_snapshot.is_some() {
            // NEW's files already are the statepoint's (a clone): its first statepoint is a
            // snapshot of them, taken before it ever ran.
            rootfs.plan(&m.statepoint_id, &mut m.local_state);
            rootfs.snapshot(&store.statepoint_dir(&m.statepoint_id), &m.local_state)?;
            store.write_manifest(&m)?;
        } else {
            rootfs.restore(&store.statepoint_dir(&m.statepoint_id), &m.local_state)?.commit();
        }
        m
    };
    leave_for_podman(&m, &store.statepoint_dir(&m.statepoint_id), &new.bundle.join("checkpoint"), None)?;
    crate::fault::point("fork.linked")?;
    progress.phase("processes (podman container restore)");
    if let Some(stats) = podman::restore(&new.id, m.options.tcp_established, true)? {
        progress.done(&stats.breakdown());
    }
    Ok(())
}

/// NEW's OCI config, which its restore reads (a never-started container has none): the source's,
/// with the source's ID (its 64, 32 and 12 first characters) and writable layer replaced by NEW's
/// throughout (the paths of its `/etc/hosts`, `/dev/shm` and root, its cgroup, its host name).
/// Podman's restore keeps it as it is but for the network namespace, which it makes anew, and
/// makes the files those paths name (`podman container init` + `stop`, which would write it,
/// cost seconds). Read under the source's lock (shared: a rollback of the source rewrites its
/// config). `None` when written; otherwise why not, and nothing written: a source not on overlay
/// storage, whose config cannot be read, or whose config holds what only `init` makes for each
/// container ([`Bundle::not_derivable`]).
fn own_bundle(src: &PodmanContainer, src_store: &ContainerStore, new: &PodmanContainer) -> Result<Option<String>> {
    let layer = |c: &PodmanContainer| {
        let diff = c.upperdir.as_deref()?;
        (diff.file_name()? == "diff").then(|| diff.parent()?.file_name()?.to_str()).flatten().map(String::from)
    };
    let (Some(src_layer), Some(new_layer)) = (layer(src), layer(new)) else {
        return Ok(Some("not on overlay storage".into()));
    };
    let _lock = src_store.lock(false)?;
    let why_not = match Bundle::load(&src.bundle) {
        Ok(b) => b.not_derivable(&src.id),
        Err(e) => Some(format!("the source's config: {e}")),
    };
    if why_not.is_some() {
        return Ok(why_not);
    }
    let prefix = |id: &str, n: usize| id.get(..n).unwrap_or(id).to_string();
    let renames = [
        (src.id.clone(), new.id.clone()),
        (src_layer, new_layer),
        (prefix(&src.id, 32), prefix(&new.id, 32)),
        (prefix(&src.id, 12), prefix(&new.id, 12)),
    ];
    let renames: Vec<(&str, &str)> = renames.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    Bundle::derive(&src.bundle, &new.bundle, &renames, &["io.planarian.mcp.branch"])?;
    Ok(None)
}

/// `podman container clone` does not copy annotations: the fork gets the source's
/// `io.planarian.*` settings in the OCI config its restore reads (and Podman saves it again).
/// A source with an MCP service gives the fork a database of its own when the service names its
/// database as `{dbname}` (a copy at the statepoint's position, made by the proxy's `branch`:
/// returned, the fork's remote state); otherwise, or when the branch is refused, the fork's
/// sidecar starts no upstream and refuses every call, saying why: the source's service is the
/// source's alone.
fn carry_settings(
    src: &PodmanContainer,
    src_cfg: &Config,
    target: &Manifest,
    new: &PodmanContainer,
) -> Result<Option<crate::store::RemoteState>> {
    let mut settings: Vec<(String, serde_json::Value)> = src
        .annotations
        .iter()
        .filter(|(k, _)| k.starts_with(crate::config::ANNOTATION_PREFIX) && k.as_str() != "io.planarian.mcp.branch")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut remote = None;
    if let Some((service, svc)) = crate::remote::sidecar::service(src_cfg)? {
        let proxy = crate::remote::sidecar::proxy_path(src_cfg)?.display().to_string();
        let state = target.remote_state.iter().find(|r| r.hook_path.as_deref() == Some(proxy.as_str()));
        let refused = |why: String| {
            serde_json::json!(format!(
                "this sandbox is a fork of {}: it has no copy of its own of MCP service {service} ({why}), so its tools are refused here (they would change the source's state)",
                src.name
            ))
        };
        let disabled = match (src_cfg.mcp.disabled.as_deref(), state) {
            (Some(_), _) => Some(refused(format!("{} has none either", src.name))),
            (None, _) if !crate::remote::sidecar::can_branch(svc) => Some(refused(if svc.database.is_empty() {
                "its state is not a database planarian can copy".into()
            } else {
                "the service does not name its database as {dbname}, so it cannot branch".into()
            })),
            (None, None) => Some(refused(format!("statepoint {} holds no database position", target.statepoint_id))),
            (None, Some(state)) => match crate::remote::hooks::branch(state, &src.id, &new.id) {
                Ok((r, database)) => {
                    settings.push(("io.planarian.mcp.branch".into(), serde_json::json!(database)));
                    remote = Some(r);
                    None
                }
                Err(e) => Some(refused(e.to_string())),
            },
        };
        if let Some(why) = disabled {
            settings.retain(|(k, _)| k != "io.planarian.mcp.disabled");
            settings.push(("io.planarian.mcp.disabled".into(), why));
        }
    }
    if !settings.is_empty() {
        Bundle::load(&new.bundle)?.set_annotations(settings)?;
    }
    Ok(remote)
}

/// The new container's first statepoint: the source statepoint's images, files and descriptors,
/// hard-linked into the new store.
fn link_statepoint(
    src: &PodmanContainer,
    src_store: &ContainerStore,
    target: &Manifest,
    store: &ContainerStore,
    remote: Option<crate::store::RemoteState>,
) -> Result<Manifest> {
    let id = store.next_id();
    let from = src_store.statepoint_dir(&target.statepoint_id);
    let dir = store.statepoint_dir(&id);
    let images = dir.join(&target.local_state.criu_checkpoint_path);
    let prev = crate::chain::link_chain(&from.join(&target.local_state.criu_checkpoint_path), store, &images)?;
    std::fs::copy(from.join("descriptors.json"), dir.join("descriptors.json"))
        .at("copy", from.join("descriptors.json"))?;
    crate::local::devfs::link(&from, &dir)?;
    if let Some(copy) = &target.local_state.rootfs_copy_path {
        crate::local::copy::cp(&["--link"], &from.join(copy), &dir.join(copy))?;
    }
    let mut m = target.clone();
    m.statepoint_id = id;
    m.parent_statepoint_id = None;
    m.container_id = store.container_id();
    m.branch_id = m.container_id.clone();
    m.timestamp = crate::log::rfc3339(std::time::SystemTime::now());
    m.state_evidence.prior_outcomes.push(Outcome::now(
        format!("forked from {} at {}", src.name, target.statepoint_id),
        OutcomeStatus::Info,
        Actor::Harness,
        None,
    ));
    m.chain.prev_images_dir = prev;
    // The remote state belongs to the source: a rollback of the fork never compensates it, but
    // compensates the fork's own branch of it, when it has one.
    m.remote_state = remote.into_iter().collect();
    m.status = Status::Committed;
    store.write_manifest(&m)?;
    store.set_head(Some(&m.statepoint_id))?;
    Ok(m)
}
