//! Asynchronous snapshots (paper §5.3), daemonless: the caller takes the container's exclusive
//! lock (waiting for tool calls in flight), reserves the statepoint's id, and hands the lock to
//! a background worker — a process of its own that inherits the locked file — then answers at
//! once with the id. Tool calls take the lock shared, so the next one waits until the worker
//! has committed or discarded the statepoint; nothing can slip in between the answer and the
//! snapshot. The worker's outcome is kept in `<store>/async/<sp>.json`, which
//! [`wait`] reads once it can take the lock itself.

use super::snapshot::{self, SnapshotRequest};
use super::{Ctx, Error, Result};
use crate::engine::Engine;
use crate::runtime::Globals;
use crate::store::ContainerStore;
use planarian_contracts::worker;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// What became of an asynchronous snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct AsyncOutcome {
    pub statepoint: String,
    /// pending, committed or failed.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<f64>,
    /// The name asked for (`snapshot --async --name N`): `statepoint wait CTR N` finds it while
    /// it is pending, before any manifest bears the name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The record of asynchronous snapshot `key`: by id, else by the name it was asked for (the
/// newest such).
fn find_record(store: &ContainerStore, key: &str) -> Option<PathBuf> {
    let by_id = record_path(store, key);
    if by_id.exists() {
        return Some(by_id);
    }
    let mut named: Vec<(u64, PathBuf)> = std::fs::read_dir(store.dir.join("async"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let o: AsyncOutcome = serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok()?;
            (o.name.as_deref() == Some(key))
                .then(|| (o.statepoint.trim_start_matches("sp").parse().unwrap_or(0), e.path()))
        })
        .collect();
    named.sort();
    named.pop().map(|(_, p)| p)
}

fn record_path(store: &ContainerStore, sp: &str) -> PathBuf {
    // (a key that is a path names no record: never a file elsewhere)
    let sp = if sp.contains('/') || sp.starts_with('.') { "-" } else { sp };
    store.dir.join("async").join(format!("{sp}.json"))
}

fn record(store: &ContainerStore, o: &AsyncOutcome) -> Result<()> {
    let text = serde_json::to_string(o).expect("an outcome serialises");
    Ok(sys::write_atomic(&record_path(store, &o.statepoint), text.as_bytes(), 0o644)?)
}

/// Starts a snapshot of the running container `name` in the background; returns its id once
/// the worker holds the lock. `worker` is the program to run as the worker (this binary), which
/// must call [`work`] when started with the arguments given.
pub fn start(engine: &Engine, name: &str, req: &SnapshotRequest, worker: &std::path::Path) -> Result<String> {
    if let Some(n) = &req.name {
        super::check_name(n)?;
    }
    let (ctx, lock) = Ctx::running_locked(engine, name)?;
    let id = ctx.store.next_id();
    record(
        &ctx.store,
        &AsyncOutcome {
            statepoint: id.clone(),
            status: "pending".into(),
            error: None,
            total_ms: None,
            name: req.name.clone(),
        },
    )?;
    let spec = worker::Snapshot {
        container: ctx.ctr.id.clone(),
        statepoint: id.clone(),
        root: engine.globals().root.as_ref().map(|r| r.display().to_string()),
        systemd_cgroup: engine.globals().systemd_cgroup,
        name: req.name.clone(),
        description: req.description.clone(),
        state: req.state.clone(),
        tcp_established: req.tcp_established,
        file_locks: req.file_locks,
    };
    let spec = serde_json::to_string(&spec).expect("a worker spec serialises");
    let spawned = spawn_worker(worker, "__snapshot-worker", &lock, &spec);
    if let Err(e) = spawned {
        let _ = std::fs::remove_file(record_path(&ctx.store, &id));
        return Err(e);
    }
    Ok(id)
}

/// The worker: holds the lock it inherited (fd `lock_fd`) until the statepoint is committed or
/// discarded, and records which.
pub fn work(engine: &Engine, lock_fd: i32, spec: &str) -> Result<()> {
    // SAFETY: the fd was inherited locked from `start`; owning it keeps the lock until we exit.
    let _lock: File = unsafe { std::os::fd::FromRawFd::from_raw_fd(lock_fd) };
    let spec: worker::Snapshot = worker::parse(spec).map_err(Error::Worker)?;
    let globals = Globals { root: spec.root.as_ref().map(PathBuf::from), systemd_cgroup: spec.systemd_cgroup };
    let (container, sp) = (spec.container.clone(), spec.statepoint.clone());
    let req = SnapshotRequest {
        tcp_established: spec.tcp_established,
        file_locks: spec.file_locks,
        leave_running: true,
        internal: false,
        name: spec.name.clone(),
        description: spec.description.clone(),
        state: spec.state.clone(),
        id: Some(sp.clone()),
    };
    let engine = &engine.with_globals(globals);
    let taken = Ctx::load(engine, &container).and_then(|ctx| snapshot::take(&ctx, &req).map(|m| (ctx, m)));
    let store = engine.store(&container);
    match taken {
        Ok((_, m)) => record(
            &store,
            &AsyncOutcome {
                statepoint: sp,
                status: "committed".into(),
                error: None,
                total_ms: Some(m.measurements.total_ms),
                name: spec.name.clone(),
            },
        ),
        Err(e) => {
            record(
                &store,
                &AsyncOutcome {
                    statepoint: sp,
                    status: "failed".into(),
                    error: Some(e.to_string()),
                    total_ms: None,
                    name: spec.name.clone(),
                },
            )?;
            Err(e)
        }
    }
}

/// Waits until statepoint `sp`'s asynchronous snapshot has ended (the worker released the lock)
/// and says how: `Ok` with the outcome when committed, the recorded error when it failed.
pub fn wait(store: &ContainerStore, sp: &str) -> Result<AsyncOutcome> {
    let path = find_record(store, sp).unwrap_or_else(|| record_path(store, sp));
    let read = || -> Option<AsyncOutcome> { serde_json::from_slice(&std::fs::read(&path).ok()?).ok() };
    let Some(first) = read() else {
        // Not asynchronous (or long forgotten): what the registry says.
        return match store.find(sp) {
            Ok(m) => Ok(AsyncOutcome {
                statepoint: m.statepoint_id,
                status: "committed".into(),
                error: None,
                total_ms: None,
                name: m.name,
            }),
            Err(e) => Err(e.into()),
        };
    };
    if first.status == "pending" {
        drop(store.lock(false)?);
    }
    match read() {
        Some(o) if o.status == "committed" => Ok(o),
        Some(AsyncOutcome { error: Some(e), .. }) => Err(Error::Worker(e)),
        _ => Err(Error::Worker(format!(
            "the snapshot worker of {sp} ended without a word (killed?): nothing was committed"
        ))),
    }
}

pub(super) fn spawn_worker(worker: &std::path::Path, verb: &str, lock: &File, spec: &str) -> Result<()> {
    let fd = lock.as_raw_fd();
    let mut cmd = std::process::Command::new(worker);
    cmd.arg(verb).arg(fd.to_string()).arg(spec);
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    // The worker is a session of its own (no signal to the caller's group reaches it) and keeps
    // the locked fd, and only it, across exec.
    crate::tools::detach_keeping(&mut cmd, &[fd]);
    cmd.spawn().map_err(|source| Error::Worker(format!("cannot start {verb} ({}): {source}", worker.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `statepoint wait CTR NAME` finds an asynchronous snapshot by the name it was asked for,
    /// while no manifest bears it yet.
    #[test]
    fn wait_finds_an_async_snapshot_by_its_name() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("async");
        let store = ContainerStore::new(&dir, "c");
        std::fs::create_dir_all(store.dir.join("async")).unwrap();
        for (id, status) in [("sp3", "failed"), ("sp7", "committed")] {
            record(
                &store,
                &AsyncOutcome {
                    statepoint: id.into(),
                    status: status.into(),
                    error: (status == "failed").then(|| "x".into()),
                    total_ms: None,
                    name: Some("tests-pass".into()),
                },
            )
            .unwrap();
        }
        assert_eq!(wait(&store, "tests-pass").unwrap().statepoint, "sp7", "the newest of that name");
        assert!(wait(&store, "sp3").is_err());
        assert!(wait(&store, "no-such").is_err());
    }
}
