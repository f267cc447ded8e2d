//! `planarian fork CTR STATEPOINT --name NEW`: a new, independent Podman container running from a
//! statepoint of CTR, while CTR keeps running untouched.
//!
//! Podman stays in charge of the new container, so `podman ps/exec/logs/stop/rm` work on it:
//!
//! 1. `podman --runtime planarian container clone CTR NEW` copies CTR's configuration (image, command, annotations,
//!    network mode) into a new container with its own ID, writable layer and, when it runs, its
//!    own network namespace;
//! 2. `podman container init` + `stop` make Podman write NEW's OCI config (its mounts, its
//!    rootfs) into NEW's bundle, which a restore reads — a never-started container has none;
//! 3. NEW gets a statepoint of its own: the statepoint's memory images and every older image of
//!    its chain hard-linked into NEW's store (no data copied; removing CTR later breaks nothing),
//!    and its files: on ZFS NEW's dataset is a clone of the statepoint's snapshot (made before
//!    step 2, so NEW's config points at it), on the copy-based path they are copied into NEW's
//!    writable layer;
//! 4. `podman container restore NEW` runs `planarian restore` through conmon, exactly as for a
//!    rollback, so NEW's first snapshot is incremental on its own base.
//!
//! Any failure removes NEW and its store; CTR is never changed.

use crate::cli::Invocation;
use crate::config::Config;
use crate::podman;
use crate::store::{ContainerStore, Manifest, Status};
use clap::Parser;
use std::ffi::OsString;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "planarian fork", about = "Start a new container from a statepoint of a container")]
struct Args {
    /// The container to fork.
    container: String,
    /// Its statepoint (id or name).
    statepoint: String,
    /// The new container's name.
    #[arg(long)]
    name: String,
}

pub fn main(_inv: &Invocation, args: &[OsString]) -> Result<i32, String> {
    let a: Args = match crate::cli::parse_verb("fork", args) {
        Ok(a) => a,
        Err(code) => return Ok(code),
    };
    let src = crate::rollback::planarian_container(&a.container)?;
    let cfg = Config::load().map_err(|e| e.to_string())?;
    let src_store = ContainerStore::new(&cfg.store.path, &src.id);
    let target = src_store.find(&a.statepoint)?;
    if podman::inspect(&a.name).is_ok() {
        return Err(format!("a container named {} already exists", a.name));
    }
    let mut progress = crate::log::Progress::start(&format!("forking {} at {} into {}", src.name, crate::rollback::describe(&target), a.name));
    // A clone gets the engine's default runtime unless told: the fork must run on planarian too.
    progress.phase("new container (podman container clone)");
    podman::run(&["--runtime", &src.runtime, "container", "clone", &src.id, &a.name])?;
    let r = fork_into(&cfg, &src, &src_store, &target, &a.name, &mut progress);
    if let Err(e) = r {
        let removed = podman::inspect(&a.name).ok();
        let _ = podman::run(&["rm", "-f", &a.name]);
        if let Some(c) = removed {
            let store = ContainerStore::new(&cfg.store.path, &c.id);
            let _ = crate::zfs_rootfs::remove_container(&cfg, &store);
            let _ = std::fs::remove_dir_all(store.dir);
        }
        drop(progress);
        return Err(format!("fork failed, nothing was created: {e}"));
    }
    progress.finish();
    let new = podman::inspect(&a.name)?;
    println!("{} forked from {} at {} ({})", a.name, src.name, target.statepoint_id, new.id);
    Ok(0)
}

fn fork_into(
    cfg: &Config,
    src: &podman::PodmanContainer,
    src_store: &ContainerStore,
    target: &Manifest,
    name: &str,
    progress: &mut crate::log::Progress,
) -> Result<(), String> {
    let src_cfg = src_config(cfg, src)?;
    let src_zfs = crate::zfs_rootfs::mapping(src_store);
    if let (Some(map), Some(snap)) = (&src_zfs, &target.local_state.zfs_snapshot) {
        progress.phase("files (a ZFS clone of the statepoint)");
        // NEW's dataset exists before its first create, which points NEW's config at it.
        let new = podman::inspect(name)?;
        let store = ContainerStore::new(&cfg.store.path, &new.id);
        let _lock = src_store.lock(true)?;
        crate::zfs_rootfs::fork_into(&src_cfg, map, snap, &store, &new.id, &new.bundle)?;
    }
    crate::fault::point("fork.cloned")?;
    progress.phase("its OCI bundle (podman container init)");
    podman::run(&["container", "init", name])?;
    podman::run(&["container", "stop", "-t", "0", name])?;
    let new = podman::inspect(name)?;
    carry_settings(src, &src_cfg, &new)?;
    podman::wait_stopped(&new.id, new.upperdir.as_deref(), Duration::from_secs(60))?;
    let store = ContainerStore::new(&cfg.store.path, &new.id);
    progress.phase("its first statepoint (images linked)");
    let m = {
        // The source's lock, so that no removal or retention runs while its images are linked.
        let _lock = src_store.lock(true)?;
        let mut m = link_statepoint(src, src_store, target, &store)?;
        let rootfs = crate::rootfs::for_container(&src_cfg, &store, &new.id, new.upperdir.clone())?;
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
    crate::snapshot::leave_for_podman(&m, &store.statepoint_dir(&m.statepoint_id), &new.bundle.join("checkpoint"), None)?;
    crate::fault::point("fork.linked")?;
    progress.phase("processes (podman container restore)");
    let mut args = vec!["container", "restore"];
    if m.options.tcp_established {
        args.push("--tcp-established");
    }
    args.push(&new.id);
    podman::run(&args)
}

/// The configuration the source container runs with (its `io.planarian.*` annotations applied).
fn src_config(cfg: &Config, src: &podman::PodmanContainer) -> Result<Config, String> {
    let a: Vec<(String, String)> = src.annotations.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect();
    cfg.with_annotations(a.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(|e| e.to_string())
}

/// `podman container clone` does not copy annotations: the fork gets the source's
/// `io.planarian.*` settings in the OCI config its restore reads (and Podman saves it again).
/// A source with an MCP service gives the fork a sidecar that refuses SQL calls: the database
/// cannot branch, and the source's remote state is the source's alone.
fn carry_settings(src: &podman::PodmanContainer, src_cfg: &Config, new: &podman::PodmanContainer) -> Result<(), String> {
    let mut settings: Vec<(String, serde_json::Value)> = src
        .annotations
        .iter()
        .filter(|(k, _)| k.starts_with(crate::config::ANNOTATION_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some((service, _)) = crate::mcp::service(src_cfg)? {
        settings.push((
            "io.planarian.mcp.disabled".into(),
            serde_json::json!(format!(
                "this sandbox is a fork of {}: the database behind MCP service {service} cannot branch, so SQL calls are refused here (they would change the source's data)",
                src.name
            )),
        ));
    }
    if settings.is_empty() {
        return Ok(());
    }
    let path = new.bundle.join("config.json");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?).map_err(|e| format!("{}: {e}", path.display()))?;
    let annotations = spec.as_object_mut().ok_or("config.json is not an object")?.entry("annotations").or_insert_with(|| serde_json::json!({}));
    for (k, v) in settings {
        annotations[k] = v;
    }
    crate::install::write_atomic(&path, serde_json::to_string(&spec).unwrap().as_bytes(), 0o644)
}

/// The new container's first statepoint: the source statepoint's images, files and descriptors,
/// hard-linked into the new store.
fn link_statepoint(src: &podman::PodmanContainer, src_store: &ContainerStore, target: &Manifest, store: &ContainerStore) -> Result<Manifest, String> {
    let id = store.next_id();
    let from = src_store.statepoint_dir(&target.statepoint_id);
    let dir = store.statepoint_dir(&id);
    let images = dir.join(&target.local_state.criu_checkpoint_path);
    let prev = crate::chain::link_chain(&from.join(&target.local_state.criu_checkpoint_path), store, &images)?;
    std::fs::copy(from.join("descriptors.json"), dir.join("descriptors.json")).map_err(|e| format!("cannot copy descriptors.json: {e}"))?;
    crate::devfs::link(&from, &dir)?;
    if let Some(copy) = &target.local_state.rootfs_copy_path {
        let out = std::process::Command::new(crate::tools::locate("cp", None, "PATH").map_err(|e| e.to_string())?)
            .args(["-a", "--link", "--no-target-directory"])
            .arg(from.join(copy))
            .arg(dir.join(copy))
            .output()
            .map_err(|e| format!("cannot run cp: {e}"))?;
        if !out.status.success() {
            return Err(format!("cannot link the statepoint's files: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
    }
    let mut m = target.clone();
    m.statepoint_id = id;
    m.parent_statepoint_id = None;
    m.container_id = store.dir.file_name().unwrap().to_string_lossy().into_owned();
    m.branch_id = m.container_id.clone();
    m.timestamp = crate::log::rfc3339(std::time::SystemTime::now());
    m.state_evidence.prior_outcomes.push(format!("forked from {} at {}", src.name, target.statepoint_id));
    m.chain.prev_images_dir = prev;
    // The remote state belongs to the source: a rollback of the fork never compensates it.
    m.remote_state.clear();
    m.status = Status::Committed;
    store.write_manifest(&m)?;
    store.set_head(Some(&m.statepoint_id))?;
    Ok(m)
}
