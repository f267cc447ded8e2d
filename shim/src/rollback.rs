//! `planarian rollback CTR STATEPOINT`: the container returns to a statepoint, under the same ID,
//! and Podman sees it running.
//!
//! exclusive lock → a safety statepoint of the current state (processes killed while frozen) →
//! the files of the statepoint put in place (the previous ones kept aside) → `podman container
//! restore`, which calls `planarian restore` through conmon. If any step fails, the container is
//! brought back to exactly where it was: the previous files and the safety statepoint.

use crate::cli::Invocation;
use crate::config::Config;
use crate::podman::{self, PodmanContainer};
use crate::snapshot::{self, Ctx, SnapshotRequest};
use crate::store::{ContainerStore, Manifest};
use std::ffi::OsString;
use std::time::Duration;

pub fn main(inv: &Invocation, args: &[OsString]) -> Result<i32, String> {
    let args: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    let [ctr, sp] = args[..] else {
        return Err("usage: planarian rollback CONTAINER STATEPOINT".into());
    };
    let pc = planarian_container(ctr)?;
    let cfg = Config::load().map_err(|e| e.to_string())?;
    let store = ContainerStore::new(&cfg.store.path, &pc.id);
    let lock = store.lock(true)?;
    let target = store.find(sp)?;
    let mut progress = crate::log::Progress::start(&format!("rolling {} back to {}", pc.name, describe(&target)));
    rollback(inv, &pc, &store, &target, &mut progress)?;
    progress.finish();
    drop(lock);
    println!("{} rolled back to {}", pc.name, target.statepoint_id);
    Ok(0)
}

/// A container that exists and runs on planarian, or a clear error.
pub fn planarian_container(name: &str) -> Result<PodmanContainer, String> {
    let pc = podman::inspect(name)?;
    if pc.runtime != "planarian" {
        return Err(format!("container {name} is not run by planarian (its runtime is {})", pc.runtime));
    }
    Ok(pc)
}

/// `sp3 (deps-installed)`, or just `sp3`.
pub fn describe(m: &Manifest) -> String {
    match &m.name {
        Some(n) => format!("{} ({n})", m.statepoint_id),
        None => m.statepoint_id.clone(),
    }
}

fn rollback(inv: &Invocation, pc: &PodmanContainer, store: &ContainerStore, target: &Manifest, progress: &mut crate::log::Progress) -> Result<(), String> {
    let cfg = Config::load().map_err(|e| e.to_string())?;
    let rootfs = crate::rootfs::for_container(&cfg, store, &pc.id, pc.upperdir.clone())?;
    if rootfs.backend() != target.local_state.rootfs_backend {
        return Err(format!(
            "statepoint {} keeps its files on the {} path but the container now uses the {} path",
            target.statepoint_id, target.local_state.rootfs_backend, rootfs.backend()
        ));
    }
    let saved = store.statepoint_dir(&target.statepoint_id);
    crate::zfs_rootfs::check_available(&cfg, store, &target.local_state)?;
    if let Some(copy) = &target.local_state.rootfs_copy_path {
        if !saved.join(copy).exists() {
            return Err(format!("statepoint {}'s files are missing from {}", target.statepoint_id, saved.join(copy).display()));
        }
    }

    // The sidecar outlives the stop and restore of a rollback: the agent's MCP connection stays
    // up, and compensation needs it.
    let _rolling = crate::mcp::RollbackMarker::set(store);

    // 1. Keep the current state until the restore succeeded.
    let safety = match pc.status.as_str() {
        "running" | "paused" => {
            progress.phase("safety statepoint of the current state");
            let ctx = Ctx::load(inv, &pc.id)?;
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
    let result = crate::fault::point("rollback.stopped")
        .and_then(|()| crate::remote::compensate(&target.remote_state, &pc.id))
        .and_then(|()| {
            progress.phase(&format!("files ({})", rootfs.backend()));
            rootfs.restore(&saved, &target.local_state)
        })
        .and_then(|files| {
            progress.phase("processes (podman container restore)");
            match crate::fault::point("rollback.files-restored").and_then(|()| podman_restore(store, pc, target)) {
                Ok(()) => {
                    files.commit();
                    Ok(())
                }
                Err(e) => {
                    files.undo().map_err(|u| format!("{e}; and putting the previous files back failed: {u}"))?;
                    Err(e)
                }
            }
        });

    match (result, safety) {
        (Ok(()), Some(s)) => {
            let _ = store.remove(&s.statepoint_id);
            Ok(())
        }
        (Ok(()), None) => Ok(()),
        (Err(e), Some(s)) => {
            // 3. Back to where it was.
            progress.phase(&format!("back to the safety statepoint {}", s.statepoint_id));
            let back = podman_restore(store, pc, &s);
            if back.is_ok() {
                progress.done("");
            }
            let _ = store.remove(&s.statepoint_id);
            match back {
                Ok(()) => Err(format!("rollback failed, the container is as it was before: {e}")),
                Err(b) => Err(format!("rollback failed: {e}; restoring the previous state failed too: {b} (its statepoint is kept)")),
            }
        }
        (Err(e), None) => Err(format!("rollback failed, the container is as it was before: {e}")),
    }
}

/// Asks Podman to restore the container from statepoint `m`, handing our lock to the restore.
fn podman_restore(store: &ContainerStore, pc: &PodmanContainer, m: &Manifest) -> Result<(), String> {
    let image_path = pc.bundle.join("checkpoint");
    let _ = std::fs::remove_dir_all(&image_path);
    snapshot::leave_for_podman(m, &store.statepoint_dir(&m.statepoint_id), &image_path, None)?;
    let handoff = serde_json::json!({ "container-id": pc.id, "pid": std::process::id() });
    crate::install::write_atomic(&store.dir.join("handoff"), handoff.to_string().as_bytes(), 0o644)?;
    let mut args = vec!["container", "restore"];
    if m.options.tcp_established {
        args.push("--tcp-established");
    }
    args.push(&pc.id);
    let r = podman::run(&args);
    let _ = std::fs::remove_file(store.dir.join("handoff"));
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&image_path);
    }
    r
}
