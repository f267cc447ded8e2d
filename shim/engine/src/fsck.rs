//! `planarian fsck`: is the store consistent, and what of it can be repaired safely.
//!
//! Per container store (`<store>/containers/<id>/`), with its lock held exclusively (a container
//! in the middle of an operation is reported busy and left alone): every statepoint directory
//! has a readable manifest; a committed statepoint has its images, every directory of its
//! chain (the `parent` links) has its images, and its files are there (the copy, or the ZFS
//! snapshot); no statepoint is left pending by a planarian that died, and no fork half-made;
//! the head names a committed statepoint; names are unique; the sandbox is not left frozen by
//! planarian; the incremental base and the sidecar's call positions are readable.
//!
//! `--repair` does only what loses nothing committed: it drops half-made statepoints (pending
//! or without a manifest) and their ZFS snapshots, thaws a sandbox a dead planarian left frozen,
//! finishes or undoes an interrupted rollback (and its compensation) and an interrupted fork
//! (see [`crate::statepoint::forking`]), clears a head that names no statepoint and an
//! unreadable base record (the next dump is full), and removes images and bases no statepoint
//! reaches. A committed statepoint that lost a part is reported, never removed: that is the
//! user's call (`planarian statepoint rm`).

use crate::config::Config;
use crate::store::{ContainerStore, Manifest, Status};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One thing found wrong.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Finding {
    /// The statepoint it concerns, when it concerns one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub statepoint: Option<String>,
    /// What was checked: manifest, pending, images, chain, files, head, name, rollback, fork,
    /// frozen, base, positions.
    pub check: &'static str,
    pub detail: String,
    /// Whether `--repair` can (or, after a repair, did) put it right.
    pub repairable: bool,
}

/// One container's store.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub container: String,
    /// Committed statepoints (internal ones included).
    pub statepoints: usize,
    /// Another planarian holds the container's lock: not checked.
    pub busy: bool,
    /// What a repair put right.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub repaired: Vec<Finding>,
    /// What is wrong now.
    pub findings: Vec<Finding>,
}

/// The ids of the containers the store holds.
pub fn containers(cfg: &Config) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(cfg.store.path.join("containers"))
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.path().is_dir())
                .filter_map(|e| e.file_name().to_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

/// Checks container `id`'s store, repairing first when asked. An operation that holds the
/// container's lock is waited for as a statepoint operation waits (`wait`, none when zero).
pub fn check_container(engine: &crate::Engine, id: &str, repair: bool, wait: std::time::Duration) -> Report {
    let cfg = engine.config();
    let store = ContainerStore::new(&cfg.store.path, id);
    let lock = match store.try_lock(true) {
        Ok(Some(l)) => Some(l),
        Ok(None) if !wait.is_zero() => store.lock_for_statepoint(wait, &mut |_| {}).ok(),
        _ => None,
    };
    let Some(_lock) = lock else {
        return Report { container: id.into(), statepoints: 0, busy: true, repaired: vec![], findings: vec![] };
    };
    let mut repaired = Vec::new();
    if repair {
        let before = findings(cfg, &store);
        if before.iter().any(|f| f.repairable) {
            mend(engine, &store);
            let after = findings(cfg, &store);
            repaired = before.into_iter().filter(|f| f.repairable && !after.contains(f)).collect();
        }
    }
    let statepoints = store.manifests().iter().filter(|m| m.status == Status::Committed).count();
    Report { container: id.into(), statepoints, busy: false, repaired, findings: findings(cfg, &store) }
}

/// The safe repairs, with the lock held.
fn mend(engine: &crate::Engine, store: &ContainerStore) {
    let cfg = engine.config();
    // (first: a half-written sandbox must not be thawed before it is stopped)
    if let Err(e) =
        crate::statepoint::journal::recover(engine.crun(), engine.globals(), cfg, store, &store.container_id())
    {
        eprintln!("planarian: {e}");
    }
    let marker = store.dir.join(crate::local::freezer::MARKER);
    if marker.exists() {
        crate::local::freezer::FreezeGuard::recover(&marker);
    }
    if let Ok(src) = crate::runtime::podman::inspect(&store.container_id()) {
        crate::statepoint::fork::recover(engine, &src, store);
    }
    crate::statepoint::discard_stale(cfg, store);
    crate::statepoint::finish_compensation(store, &store.container_id());
    if let Some(head) = store.head() {
        if store.find(&head).is_err() {
            let _ = store.set_head(None);
        }
    }
    if store.dir.join("base").exists() && crate::chain::read_base(store).is_none() {
        // The next dump is full, as it is when the record says why there is no base.
        let _ = std::fs::remove_file(store.dir.join("base"));
    }
    crate::chain::collect(store);
}

/// What is wrong in `store` now. (Long: one list of independent checks, each a few lines, in the
/// order a report shows them; cut apart, each piece would take the same five arguments.)
pub fn findings(cfg: &Config, store: &ContainerStore) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut add = |sp: Option<&str>, check: &'static str, detail: String, repairable: bool| {
        out.push(Finding { statepoint: sp.map(String::from), check, detail, repairable })
    };
    let sps = store.dir.join("statepoints");
    let mut manifests: Vec<Manifest> = Vec::new();
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&sps).map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect()).unwrap_or_default();
    dirs.sort();
    for dir in dirs {
        let sp = dir.file_name().and_then(|n| n.to_str()).unwrap_or("?").to_string();
        let path = dir.join("manifest.json");
        if !path.exists() {
            add(Some(&sp), "manifest", "no manifest: a statepoint planarian did not finish making".into(), true);
            continue;
        }
        match crate::store::read_manifest(&path) {
            Ok(m) => manifests.push(m),
            Err(e) => {
                add(Some(&sp), "manifest", format!("{e} (left as it is: remove it by hand if it is not needed)"), false)
            }
        }
    }
    let mut names: std::collections::HashMap<&str, &str> = Default::default();
    for m in &manifests {
        let sp = Some(m.statepoint_id.as_str());
        let dir = store.statepoint_dir(&m.statepoint_id);
        match m.status {
            Status::Pending => {
                add(sp, "pending", "a statepoint a planarian that stopped did not commit".into(), true);
                continue;
            }
            Status::Discarded => continue,
            Status::Committed => {}
        }
        if let Some(n) = m.name.as_deref() {
            if let Some(other) = names.insert(n, &m.statepoint_id) {
                add(
                    sp,
                    "name",
                    format!("the name {n:?} is also {other}'s (rename one: planarian statepoint set)"),
                    false,
                );
            }
        }
        let images = dir.join(&m.local_state.criu_checkpoint_path);
        if let Err(why) = images_complete(&images) {
            add(sp, "images", why, false);
        } else if let Err(why) = chain_complete(&images) {
            add(sp, "chain", why, false);
        }
        if let Some(copy) = &m.local_state.rootfs_copy_path {
            if !dir.join(copy).is_dir() {
                add(sp, "files", format!("the copy of its files ({}) is missing", dir.join(copy).display()), false);
            }
        }
        if m.local_state.zfs_snapshot.is_some() {
            if let Err(e) = crate::local::zfs::check_available(cfg, store, &m.local_state) {
                add(sp, "files", e.to_string(), false);
            }
        }
    }
    if let Some(head) = store.head() {
        if !manifests.iter().any(|m| m.statepoint_id == head && m.status == Status::Committed) {
            add(None, "head", format!("the head names {head}, which is not a committed statepoint"), true);
        }
    }
    if let Some(target) = crate::statepoint::journal::interrupted_to(store) {
        add(
            None,
            "rollback",
            format!(
                "a rollback to {target} was interrupted (repaired: finished, or undone with its safety statepoint)"
            ),
            true,
        );
    }
    for f in crate::statepoint::forking::interrupted(store) {
        add(
            None,
            "fork",
            format!(
                "a fork of {} into {} was interrupted (repaired: finished if it runs, else removed)",
                f.statepoint, f.name
            ),
            true,
        );
    }
    let marker = store.dir.join(crate::local::freezer::MARKER);
    if marker.exists() {
        add(None, "frozen", "the sandbox was left frozen by a planarian that stopped".into(), true);
    }
    if store.dir.join("base").exists() {
        match crate::chain::read_base(store) {
            None => add(None, "base", "the incremental base record is unreadable (the next dump is full)".into(), true),
            Some(b) => {
                if let Some(images) = b.images.filter(|i| !store.dir.join(i).join("inventory.img").exists()) {
                    add(None, "base", format!("the incremental base {images} is gone (the next dump is full)"), false);
                }
            }
        }
    }
    let positions = store.dir.join("mcp-positions.json");
    if let Ok(data) = std::fs::read(&positions) {
        if let Err(e) = serde_json::from_slice::<serde_json::Value>(&data) {
            add(None, "positions", format!("{}: {e}", positions.display()), false);
        }
    }
    out
}

/// A CRIU images directory has its inventory (every dump writes it).
fn images_complete(images: &Path) -> Result<(), String> {
    if !images.is_dir() {
        return Err(format!("its memory images ({}) are missing", images.display()));
    }
    if !images.join("inventory.img").is_file() {
        return Err(format!("its memory images ({}) have no inventory.img", images.display()));
    }
    Ok(())
}

/// Every directory an incremental dump's `parent` links lead to is there, with its images.
fn chain_complete(images: &Path) -> Result<(), String> {
    let chain = crate::chain::chain_of(images);
    for dir in &chain[1..] {
        images_complete(dir).map_err(|why| format!("an earlier dump it builds on: {why}"))?;
    }
    // (the chain stops where a directory comes again: then the last still has a parent)
    match chain.last().and_then(|d| crate::chain::parent_of(d)) {
        Some(again) => Err(format!("the chain of {} loops at {}", images.display(), again.display())),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{self, Chain, LocalState};
    use std::time::Duration;

    fn manifest(id: &str, status: Status, name: Option<&str>) -> Manifest {
        Manifest {
            statepoint_id: id.into(),
            parent_statepoint_id: None,
            branch_id: "c".into(),
            container_id: "c".into(),
            timestamp: String::new(),
            name: name.map(String::from),
            state_evidence: Default::default(),
            local_state: LocalState {
                criu_checkpoint_path: "criu".into(),
                rootfs_backend: "copy".into(),
                rootfs_copy_path: Some("rootfs".into()),
                ..Default::default()
            },
            remote_state: vec![],
            status,
            internal: false,
            options: Default::default(),
            measurements: Default::default(),
            chain: Chain::default(),
            imported_from: None,
            rollbacks: vec![],
            unreachable: None,
        }
    }

    /// A statepoint with its images and files; `parent`: the images it builds on.
    fn make(s: &ContainerStore, id: &str, name: Option<&str>, parent: Option<&str>) {
        let dir = s.statepoint_dir(id);
        std::fs::create_dir_all(dir.join("criu")).unwrap();
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        std::fs::write(dir.join("criu/inventory.img"), b"x").unwrap();
        if let Some(p) = parent {
            std::os::unix::fs::symlink(format!("../../{p}/criu"), dir.join("criu/parent")).unwrap();
        }
        s.write_manifest(&manifest(id, Status::Committed, name)).unwrap();
    }

    /// A configuration whose store is in a scratch directory (removed when the first is
    /// dropped), and container "c"'s store there.
    fn setup(tag: &str) -> (tempfile::TempDir, Config, ContainerStore) {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join(tag);
        let mut cfg = Config::default();
        cfg.store.path = root.clone();
        let s = ContainerStore::new(&root, "c");
        std::fs::create_dir_all(s.dir.join("statepoints")).unwrap();
        (scratch, cfg, s)
    }

    /// [`check_container`] of container "c", repairing when asked, waiting for the lock as an
    /// operation does (a child another test forks holds a copy of every descriptor of this
    /// process, this test's lock among them, until it execs).
    fn check(cfg: &Config, repair: bool) -> Report {
        check_waiting(cfg, repair, Duration::from_secs(30))
    }

    fn check_waiting(cfg: &Config, repair: bool, wait: Duration) -> Report {
        check_container(&crate::Engine::with_config(cfg.clone(), Default::default()), "c", repair, wait)
    }

    fn checks(f: &[Finding]) -> Vec<(Option<&str>, &str)> {
        f.iter().map(|f| (f.statepoint.as_deref(), f.check)).collect()
    }

    #[test]
    fn a_sound_store_has_no_findings() {
        let (_scratch, cfg, s) = setup("sound");
        make(&s, "sp1", Some("a"), None);
        make(&s, "sp2", Some("b"), Some("sp1"));
        s.set_head(Some("sp2")).unwrap();
        let r = check(&cfg, false);
        assert_eq!((r.statepoints, r.busy, r.findings), (2, false, vec![]));
    }

    #[test]
    fn lost_parts_are_found_and_never_repaired_away() {
        let (_scratch, cfg, s) = setup("lost");
        make(&s, "sp1", Some("same"), None);
        make(&s, "sp2", Some("same"), Some("sp1"));
        make(&s, "sp3", None, None);
        make(&s, "sp4", None, None);
        std::fs::remove_file(s.statepoint_dir("sp1").join("criu/inventory.img")).unwrap();
        std::fs::remove_dir_all(s.statepoint_dir("sp3").join("rootfs")).unwrap();
        std::fs::write(s.statepoint_dir("sp4").join("manifest.json"), b"{ not json").unwrap();
        std::fs::write(s.dir.join("mcp-positions.json"), b"[").unwrap();
        let want = vec![
            (Some("sp4"), "manifest"),
            (Some("sp1"), "images"),
            (Some("sp2"), "name"),
            (Some("sp2"), "chain"),
            (Some("sp3"), "files"),
            (None, "positions"),
        ];
        assert_eq!(checks(&findings(&cfg, &s)), want);
        // Nothing of it is the repair's: every part stays as it was.
        let r = check(&cfg, true);
        assert!(r.repaired.is_empty(), "{:?}", r.repaired);
        assert_eq!(checks(&r.findings), want);
        for sp in ["sp1", "sp2", "sp3", "sp4"] {
            assert!(s.statepoint_dir(sp).join("manifest.json").exists(), "{sp}");
        }
    }

    #[test]
    fn what_a_dead_planarian_left_is_repaired_and_nothing_committed_is_touched() {
        let (_scratch, cfg, s) = setup("dead");
        make(&s, "sp1", None, None);
        make(&s, "sp2", None, Some("sp1"));
        // A snapshot killed half-way (pending, its images begun), one killed before its
        // manifest, a head that names a statepoint removed since, an unreadable base.
        std::fs::create_dir_all(s.statepoint_dir("sp3").join("criu")).unwrap();
        s.write_manifest(&manifest("sp3", Status::Pending, None)).unwrap();
        std::fs::create_dir_all(s.statepoint_dir("sp4").join("criu")).unwrap();
        s.set_head(Some("sp9")).unwrap();
        std::fs::write(s.dir.join("base"), b"garbage").unwrap();
        let found = check(&cfg, false);
        assert_eq!(
            checks(&found.findings),
            vec![(Some("sp4"), "manifest"), (Some("sp3"), "pending"), (None, "head"), (None, "base")]
        );
        assert!(found.findings.iter().all(|f| f.repairable));
        assert!(s.statepoint_dir("sp3").exists(), "a check alone changes nothing");

        let r = check(&cfg, true);
        assert_eq!(checks(&r.repaired).len(), 4, "{:?}", r.repaired);
        assert!(r.findings.is_empty(), "{:?}", r.findings);
        assert!(!s.statepoint_dir("sp3").exists() && !s.statepoint_dir("sp4").exists());
        assert_eq!(s.head(), None);
        assert!(s.statepoint_dir("sp1").join("criu/inventory.img").exists());
        assert!(s.statepoint_dir("sp2").join("criu/inventory.img").exists());
        assert_eq!(
            store::read_manifest(&s.statepoint_dir("sp2").join("manifest.json")).unwrap().status,
            Status::Committed
        );
    }

    #[test]
    fn an_interrupted_rollback_is_found() {
        let (_scratch, cfg, s) = setup("rollback");
        make(&s, "sp1", None, None);
        // As a planarian killed mid-rollback leaves its journal.
        let journal = r#"{"pid":4294967295,"target":"sp1","safety":"sp2","from":null,"init":[1,0],"phase":"writing"}"#;
        std::fs::write(s.dir.join("rolling-back.json"), journal).unwrap();
        let f = findings(&cfg, &s);
        assert_eq!(checks(&f), vec![(None, "rollback")]);
        assert!(f[0].repairable && f[0].detail.contains("sp1"), "{f:?}");
    }

    #[test]
    fn a_container_in_an_operation_is_left_alone() {
        let (_scratch, cfg, s) = setup("busy");
        std::fs::create_dir_all(s.statepoint_dir("sp1")).unwrap();
        let _held = s.lock(true).unwrap();
        let r = check_waiting(&cfg, true, Duration::ZERO);
        assert!(r.busy && r.findings.is_empty());
        assert!(s.statepoint_dir("sp1").exists());
    }
}
