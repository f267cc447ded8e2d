//! Incremental chains across restore, rollback and fork (Algorithm 1 of the paper).
//!
//! Every dump runs with `--track-mem` and, until the branch reaches the full-dump interval k,
//! `--prev-images-dir` pointing at the *base* of the running process tree:
//!
//! * after a dump, the base is that statepoint's images (CRIU cleared the soft-dirty bits);
//! * after a restore, the base is a directory of the container's own (`bases/bN`): hard links to
//!   the restored statepoint's `pagemap*`/`pages*` images, its `parent` link, and a copy of its
//!   `inventory.img` whose `dump_uptime` is E, the epoch the pre-resume hook waited out after
//!   clearing the soft-dirty bits. The statepoint's own images are never changed, so another
//!   branch (the source of a fork, a second fork) that uses them keeps its own, correct base.
//!
//! `<store>/containers/<id>/base` records the base with the start time of the container's init:
//! a different process tree (a restarted container) is never dumped against it. No base, or a
//! restore whose hook recorded no E, makes the next dump full, and the manifest says why.
//!
//! All links are relative, so a chain survives Podman deleting its checkpoint directory and
//! the store being moved. Removing a statepoint keeps its images while a later dump or base
//! links to them; [`collect`] deletes what nothing reaches any more.

use crate::store::{ContainerStore, Manifest, Status};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};
use sys::Context;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error("{}/inventory.img: {source}", images.display())]
    Inventory { images: PathBuf, source: criu_hooks::ImageError },
    #[error("the incremental chain of {} is broken at {}", images.display(), at.display())]
    Broken { images: PathBuf, at: PathBuf },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a restore's pre-resume hook left: E in microseconds, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Epoch {
    Recorded(u64),
    Missing(String),
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Base {
    /// The images the next dump builds on, relative to the container's store directory.
    pub images: Option<String>,
    /// Incremental dumps between those images and the last full dump.
    pub depth: u32,
    /// Start time (clock ticks) of the container's init when the base was recorded.
    pub init_start_time: u64,
    /// Why the next dump is full, when there is no base.
    pub full_reason: Option<String>,
}

impl Base {
    /// No base: the next dump is full, for reason `why`.
    pub fn full(init_start_time: u64, why: impl Into<String>) -> Base {
        Base { images: None, depth: 0, init_start_time, full_reason: Some(why.into()) }
    }
}

/// How the next dump relates to its parent.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpChain {
    /// `--prev-images-dir`, relative to the new images directory; None for a full dump.
    pub prev_images_dir: Option<String>,
    pub depth: u32,
    pub full_reason: Option<String>,
}

fn base_file(store: &ContainerStore) -> PathBuf {
    store.dir.join("base")
}

pub fn read_base(store: &ContainerStore) -> Option<Base> {
    serde_json::from_slice(&std::fs::read(base_file(store)).ok()?).ok()
}

pub fn write_base(store: &ContainerStore, b: &Base) -> Result<()> {
    let text = serde_json::to_string_pretty(b).expect("a base serialises");
    Ok(sys::write_atomic(&base_file(store), text.as_bytes(), 0o644)?)
}

/// What the next dump of the tree whose init started at `init_start` builds on, for a new
/// statepoint `sp_id`, with a full dump every `k` statepoints.
pub fn plan(store: &ContainerStore, sp_id: &str, init_start: u64, k: u32) -> DumpChain {
    let full = |why: &str| DumpChain { prev_images_dir: None, depth: 0, full_reason: Some(why.to_string()) };
    let Some(base) = read_base(store) else {
        return full("first statepoint of this process tree");
    };
    let Some(images) = base.images else {
        return full(base.full_reason.as_deref().unwrap_or("no incremental base"));
    };
    if base.init_start_time != init_start {
        return full("the container was restarted since its last statepoint");
    }
    if base.depth + 1 >= k.max(1) {
        return full(&format!("full-dump interval reached ({k})"));
    }
    if !store.dir.join(&images).join("inventory.img").exists() {
        return full(&format!("the base images {images} are gone"));
    }
    let new_images = Path::new("statepoints").join(sp_id).join("criu");
    DumpChain {
        prev_images_dir: Some(relative(&new_images, Path::new(&images))),
        depth: base.depth + 1,
        full_reason: None,
    }
}

/// After a committed dump of a running tree: the next dump builds on these images.
pub fn after_dump(store: &ContainerStore, m: &Manifest, init_start: u64) -> Result<()> {
    write_base(
        store,
        &Base {
            images: Some(format!("statepoints/{}/{}", m.statepoint_id, m.local_state.criu_checkpoint_path)),
            depth: m.chain.depth,
            init_start_time: init_start,
            full_reason: None,
        },
    )
}

/// A dump that CRIU started but that was not committed: CRIU may have cleared the soft-dirty bits
/// of some or all tasks, so the pages written since the current base are in no image that will
/// be kept. From [`DumpInProgress::begin`] until the guard is disarmed, dropping it makes the next
/// dump of the tree full (an incremental one would silently miss those pages). A statepoint that
/// takes no dump (its tree did nothing) never begins it: nothing clears the bits.
pub struct DumpInProgress<'a> {
    store: &'a ContainerStore,
    init_start: u64,
    armed: std::sync::atomic::AtomicBool,
}

impl<'a> DumpInProgress<'a> {
    /// The guard of a dump that may come, not yet begun (nothing written).
    pub fn ready(store: &'a ContainerStore, init_start: u64) -> DumpInProgress<'a> {
        DumpInProgress { store, init_start, armed: std::sync::atomic::AtomicBool::new(false) }
    }

    /// CRIU is about to run. Written at once, not only when dropped: a planarian killed during
    /// the dump runs no destructor, and its successor must not dump incrementally (nor take the
    /// tree as unchanged) against a base whose soft-dirty bits CRIU may have cleared.
    pub fn begin(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::Relaxed);
        self.invalidate("the last dump was not committed (CRIU may have cleared the soft-dirty bits)");
    }

    fn invalidate(&self, why: &str) {
        invalidate_base(self.store, self.init_start, why);
    }

    /// The dump (or the statepoint without one) was committed and its own base written
    /// ([`after_dump`]).
    pub fn committed(mut self) {
        *self.armed.get_mut() = false;
    }
}

impl Drop for DumpInProgress<'_> {
    fn drop(&mut self) {
        if *self.armed.get_mut() {
            self.invalidate("the last dump was not committed (CRIU may have cleared the soft-dirty bits)");
        }
    }
}

/// The next dump of the tree is full, for the reason given: something cleared the soft-dirty
/// bits (a dump that did not commit, a pre-dump), so no base says what changed.
pub fn invalidate_base(store: &ContainerStore, init_start: u64, why: &str) {
    let _ = write_base(store, &Base::full(init_start, why));
}

/// After a restore of statepoint `m`: a base of the container's own, with `dump_uptime` = E (µs),
/// or, when the hook recorded no E, a note that the next dump must be full.
pub fn after_restore(store: &ContainerStore, m: &Manifest, epoch_usec: Epoch, init_start: u64) -> Result<()> {
    let base = match epoch_usec {
        Epoch::Recorded(e) => {
            let images = store.statepoint_dir(&m.statepoint_id).join(&m.local_state.criu_checkpoint_path);
            let name = new_base_dir(store, &images, e)?;
            Base { images: Some(name), depth: m.chain.depth, init_start_time: init_start, full_reason: None }
        }
        Epoch::Missing(why) => Base::full(init_start, why),
    };
    write_base(store, &base)?;
    collect(store);
    Ok(())
}

/// The number of the next `bases/bN` (never reused while an older one exists).
fn next_base(store: &ContainerStore) -> Result<u64> {
    let bases = store.dir.join("bases");
    std::fs::create_dir_all(&bases).at("create", &bases)?;
    let max = std::fs::read_dir(&bases)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .trim_start_matches('.')
                        .strip_prefix('b')?
                        .trim_end_matches(".tmp")
                        .parse::<u64>()
                        .ok()
                })
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    Ok(max + 1)
}

/// Creates `bases/bN` from `images` with a rewritten inventory; returns its store-relative path.
fn new_base_dir(store: &ContainerStore, images: &Path, dump_uptime_usec: u64) -> Result<String> {
    let n = next_base(store)?;
    let rel = format!("bases/b{n}");
    let dir = store.dir.join(&rel);
    let tmp = store.dir.join(format!("bases/.b{n}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    let r = link_images(images, &tmp, &store.dir, &dir).and_then(|()| {
        let inv = std::fs::read(images.join("inventory.img")).at("read", images.join("inventory.img"))?;
        let new = criu_hooks::set_dump_uptime(&inv, dump_uptime_usec)
            .map_err(|source| Error::Inventory { images: images.to_path_buf(), source })?;
        sys::write_atomic(&tmp.join("inventory.img"), &new, 0o644)?;
        Ok(std::fs::rename(&tmp, &dir).at("create", &dir)?)
    });
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    r.map(|()| rel)
}

/// Fills `into` (which will be renamed to `final_dir`, under `ctr_dir`) with hard links to the
/// memory images of `images` and a `parent` link to the same directory `images`'s points at.
pub fn link_images(images: &Path, into: &Path, ctr_dir: &Path, final_dir: &Path) -> Result<()> {
    std::fs::create_dir_all(into).at("create", into)?;
    let rd = std::fs::read_dir(images).at("read", images)?;
    for e in rd.filter_map(Result::ok) {
        let name = e.file_name();
        let s = name.to_string_lossy();
        if s.starts_with("pagemap") || s.starts_with("pages-") {
            std::fs::hard_link(e.path(), into.join(&name)).at("link", e.path())?;
        }
    }
    if let Some(parent) = parent_of(images) {
        let target = relative(
            final_dir.strip_prefix(ctr_dir).unwrap_or(final_dir),
            parent.strip_prefix(ctr_dir).unwrap_or(&parent),
        );
        std::os::unix::fs::symlink(&target, into.join("parent")).at("link parent in", into)?;
    }
    Ok(())
}

/// The directory an images directory's `parent` link points at (lexically resolved).
pub fn parent_of(images: &Path) -> Option<PathBuf> {
    let target = std::fs::read_link(images.join("parent")).ok()?;
    Some(normalize(&images.join(target)))
}

/// `to` relative to `from` (both relative to the same root, or both absolute), lexically.
pub fn relative(from: &Path, to: &Path) -> String {
    let (from, to) = (normalize(from), normalize(to));
    let f: Vec<Component> = from.components().collect();
    let t: Vec<Component> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c);
    }
    out.display().to_string()
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Deletes bases and the images of removed statepoints that no statepoint, and not the current
/// base, reaches through `parent` links any more. Call with the exclusive lock held.
pub fn collect(store: &ContainerStore) {
    let manifests = store.summaries();
    let mut roots: Vec<PathBuf> = manifests
        .iter()
        .filter(|m| m.status != Status::Discarded)
        .map(|m| store.statepoint_dir(&m.statepoint_id).join(&m.local_state.criu_checkpoint_path))
        .collect();
    if let Some(images) = read_base(store).and_then(|b| b.images) {
        roots.push(store.dir.join(images));
    }
    let mut live: HashSet<PathBuf> = HashSet::new();
    for mut dir in roots {
        loop {
            let dir_n = normalize(&dir);
            if !live.insert(dir_n.clone()) {
                break;
            }
            match parent_of(&dir_n) {
                Some(p) => dir = p,
                None => break,
            }
        }
    }
    for m in manifests.iter().filter(|m| m.status == Status::Discarded) {
        let sp = store.statepoint_dir(&m.statepoint_id);
        if !live.contains(&normalize(&sp.join(&m.local_state.criu_checkpoint_path))) {
            let _ = std::fs::remove_dir_all(sp);
        }
    }
    if let Ok(rd) = std::fs::read_dir(store.dir.join("bases")) {
        for e in rd.filter_map(Result::ok) {
            if !live.contains(&normalize(&e.path())) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Gives another container's store its own copy of the chain of `images` (hard links, no data
/// copied): the newest directory becomes `into`, the older ones `bases/bN` of that store, each
/// with a `parent` link to the next. The source can then be removed without breaking the copy.
pub fn link_chain(images: &Path, store: &ContainerStore, into: &Path) -> Result<Option<String>> {
    let chain = chain_of(images);
    let mut parent: Option<PathBuf> = None;
    for (i, src) in chain.iter().enumerate().rev() {
        let dest = if i == 0 { into.to_path_buf() } else { store.dir.join(format!("bases/b{}", next_base(store)?)) };
        link_files(src, &dest)?;
        if let Some(p) = &parent {
            std::os::unix::fs::symlink(relative(&dest, p), dest.join("parent")).at("link parent in", &dest)?;
        }
        parent = Some(dest);
    }
    Ok(std::fs::read_link(into.join("parent")).ok().map(|p| p.display().to_string()))
}

/// The directory, inside a handed-out images directory, that holds its older levels.
pub const HANDED_OUT_CHAIN: &str = "planarian-chain";

/// Lays the chain of `images` out in `out` so that the directory restores on its own, anywhere:
/// the newest level's files in `out`, each older one in `out/planarian-chain/N`, every `parent`
/// link inside `out`. Files are hard links where `out` is on the same file system (no data
/// copied), copies otherwise. Returns the number of levels.
pub fn hand_out(images: &Path, out: &Path) -> Result<usize> {
    let chain = chain_of(images);
    let level = |i: usize| if i == 0 { out.to_path_buf() } else { out.join(HANDED_OUT_CHAIN).join(i.to_string()) };
    for (i, src) in chain.iter().enumerate() {
        if !src.join("inventory.img").exists() {
            return Err(Error::Broken { images: images.to_path_buf(), at: src.clone() });
        }
        let dest = level(i);
        link_files(src, &dest)?;
        if i + 1 < chain.len() {
            std::os::unix::fs::symlink(relative(&dest, &level(i + 1)), dest.join("parent"))
                .at("link parent in", &dest)?;
        }
    }
    Ok(chain.len())
}

/// What separates the parts of a path in a flat handed-out directory's file names.
const FLAT_SEP: char = '%';

/// Lays a handed-out directory `dir` ([`hand_out`], with planarian's part in `part`) out flat,
/// for a caller that keeps only its top level's regular files: containerd unpacks a
/// checkpoint's directory entry by entry as plain files (a subdirectory becomes an empty file
/// and its files are lost; a link becomes an empty file). Each file of a subdirectory `a/b/f`
/// becomes `a%b%f`; the `parent` links go ([`unflatten`] makes them again).
pub fn flatten(dir: &Path, part: &str) -> Result<()> {
    let _ = std::fs::remove_file(dir.join("parent"));
    for sub in [HANDED_OUT_CHAIN, part] {
        let top = dir.join(sub);
        if !top.is_dir() {
            continue;
        }
        let mut stack = vec![PathBuf::from(sub)];
        while let Some(rel) = stack.pop() {
            let here = dir.join(&rel);
            for e in std::fs::read_dir(&here).at("read", &here)?.filter_map(std::result::Result::ok) {
                let t = e.file_type().at("read", e.path())?;
                let child = rel.join(e.file_name());
                if t.is_dir() {
                    stack.push(child);
                } else if t.is_file() {
                    let flat: Vec<String> = child.iter().map(|c| c.to_string_lossy().into_owned()).collect();
                    let to = dir.join(flat.join(&FLAT_SEP.to_string()));
                    std::fs::rename(e.path(), &to).at("rename", e.path())?;
                }
                // (a `parent` link: made again by unflatten)
            }
        }
        std::fs::remove_dir_all(&top).at("remove", &top)?;
    }
    Ok(())
}

/// Puts a directory [`flatten`] laid out back as [`hand_out`] made it (its subdirectories and
/// `parent` links); nothing when it is not flat. A name that would lead out of `dir` is refused.
pub fn unflatten(dir: &Path, part: &str) -> Result<()> {
    let flat = flat_names(dir, part)?;
    if flat.is_empty() {
        return Ok(());
    }
    // (a flat directory has neither: what is there would be written into, or through)
    for sub in [HANDED_OUT_CHAIN, part] {
        if std::fs::symlink_metadata(dir.join(sub)).is_ok() {
            return Err(Error::Broken { images: dir.to_path_buf(), at: dir.join(sub) });
        }
    }
    for (name, rel) in &flat {
        // Only plain names.
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(Error::Broken { images: dir.to_path_buf(), at: dir.join(name) });
        }
    }
    for (name, rel) in &flat {
        let to = dir.join(rel);
        let parent = to.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent).at("create", parent)?;
        if std::fs::symlink_metadata(&to).is_ok() {
            return Err(Error::Broken { images: dir.to_path_buf(), at: dir.join(name) });
        }
        std::fs::rename(dir.join(name), &to).at("rename", dir.join(name))?;
    }
    // Each level's parent is the next one: planarian-chain/1 for the top, N+1 for N.
    let level = |i: usize| if i == 0 { dir.to_path_buf() } else { dir.join(HANDED_OUT_CHAIN).join(i.to_string()) };
    let mut i = 0;
    while level(i + 1).join("inventory.img").is_file() {
        let link = level(i).join("parent");
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(relative(&level(i), &level(i + 1)), &link).at("link parent in", level(i))?;
        }
        i += 1;
    }
    Ok(())
}

/// Whether `dir` is a handed-out directory laid out flat ([`flatten`]).
pub fn is_flat(dir: &Path, part: &str) -> bool {
    flat_names(dir, part).is_ok_and(|f| !f.is_empty())
}

/// The flat names of `dir` ([`flatten`]), each with the path it stands for.
fn flat_names(dir: &Path, part: &str) -> Result<Vec<(String, PathBuf)>> {
    Ok(std::fs::read_dir(dir)
        .at("read", dir)?
        .filter_map(std::result::Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .filter(|n| [HANDED_OUT_CHAIN, part].iter().any(|p| n.starts_with(&format!("{p}{FLAT_SEP}"))))
        .map(|n| {
            let rel: PathBuf = n.split(FLAT_SEP).collect();
            (n, rel)
        })
        .collect())
}

/// Hard links (copies across file systems) of the regular files of `src` in `dest`, which is
/// created; files already in `dest` are replaced.
pub fn link_files(src: &Path, dest: &Path) -> Result<()> {
    std::fs::create_dir_all(dest).at("create", dest)?;
    let rd = std::fs::read_dir(src).at("read", src)?;
    for e in rd.filter_map(Result::ok) {
        if e.file_type().is_ok_and(|t| t.is_file()) {
            let to = dest.join(e.file_name());
            let _ = std::fs::remove_file(&to);
            if std::fs::hard_link(e.path(), &to).is_err() {
                std::fs::copy(e.path(), &to).at("copy", e.path())?;
            }
        }
    }
    Ok(())
}

/// Pages CRIU scanned, skipped because the parent had them, and wrote, for the dump in `images`.
pub fn dump_stats(images: &Path) -> Option<criu_hooks::DumpStats> {
    criu_hooks::dump_stats(&std::fs::read(images.join("stats-dump")).ok()?).ok()
}

/// The chain of image directories a restore of `images` reads, newest first.
pub fn chain_of(images: &Path) -> Vec<PathBuf> {
    let mut out = vec![normalize(images)];
    while let Some(p) = parent_of(out.last().unwrap()) {
        if out.contains(&p) || out.len() > 4096 {
            break;
        }
        out.push(p);
    }
    out
}

/// Whether every directory of the chain of `images` is present (a restore can read it).
pub fn complete(images: &Path) -> Result<()> {
    for d in chain_of(images) {
        if !d.join("inventory.img").exists() {
            return Err(Error::Broken { images: images.to_path_buf(), at: d });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::manifest;

    /// A container's store in a scratch directory (removed when the first is dropped).
    fn tmp(tag: &str) -> (tempfile::TempDir, ContainerStore) {
        let scratch = tempfile::tempdir().unwrap();
        let s = ContainerStore::new(&scratch.path().join(tag), "c");
        std::fs::create_dir_all(&s.dir).unwrap();
        (scratch, s)
    }

    #[test]
    fn a_dump_not_committed_makes_the_next_one_full_and_a_committed_one_does_not() {
        let (_scratch, s) = tmp("inprogress");
        let m = dump(&s, "sp1", None, 0);
        after_dump(&s, &m, 42).unwrap();
        assert!(plan(&s, "sp2", 42, 8).prev_images_dir.is_some());
        // (a guard never begun, as a statepoint that took no dump has: the base stays)
        drop(DumpInProgress::ready(&s, 42));
        assert_eq!(plan(&s, "sp2", 42, 8).prev_images_dir.as_deref(), Some("../../sp1/criu"), "no dump began");
        let g = DumpInProgress::ready(&s, 42);
        assert!(plan(&s, "sp2", 42, 8).prev_images_dir.is_some(), "nothing written before the dump begins");
        g.begin();
        // (while it runs, a planarian killed now leaves no base: the next dump is full)
        assert_eq!(plan(&s, "sp2", 42, 8).prev_images_dir, None, "no base during a dump");
        let m2 = dump(&s, "sp2", Some("../../sp1/criu"), 1);
        after_dump(&s, &m2, 42).unwrap();
        g.committed();
        assert_eq!(
            plan(&s, "sp3", 42, 8).prev_images_dir.as_deref(),
            Some("../../sp2/criu"),
            "a committed dump is the base"
        );
        // (begun, then dropped before it was committed, even after its base was written: the
        // invalidation comes from the drop, not only from the begin)
        let g = DumpInProgress::ready(&s, 42);
        g.begin();
        after_dump(&s, &m2, 42).unwrap();
        drop(g);
        let p = plan(&s, "sp3", 42, 8);
        assert_eq!(p.prev_images_dir, None);
        assert!(p.full_reason.unwrap().contains("not committed"));
        let _ = std::fs::remove_dir_all(&s.dir);
    }

    /// A fake dump: a statepoint with an inventory, one pages file, optionally a parent link.
    fn dump(s: &ContainerStore, id: &str, prev: Option<&str>, depth: u32) -> Manifest {
        let mut m = manifest(id, Status::Committed);
        m.local_state.criu_checkpoint_path = "criu".into();
        m.chain.depth = depth;
        m.chain.prev_images_dir = prev.map(String::from);
        let images = s.statepoint_dir(id).join("criu");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::write(
            images.join("inventory.img"),
            include_bytes!("../../../criu-hooks/tests/fixtures/inventory-3.17.img"),
        )
        .unwrap();
        std::fs::write(images.join("pages-1.img"), id).unwrap();
        std::fs::write(images.join("pagemap-1.img"), id).unwrap();
        if let Some(p) = prev {
            std::os::unix::fs::symlink(p, images.join("parent")).unwrap();
        }
        s.write_manifest(&m).unwrap();
        m
    }

    #[test]
    fn relative_paths() {
        assert_eq!(relative(Path::new("statepoints/sp2/criu"), Path::new("statepoints/sp1/criu")), "../../sp1/criu");
        assert_eq!(relative(Path::new("statepoints/sp3/criu"), Path::new("bases/b1")), "../../../bases/b1");
        assert_eq!(relative(Path::new("bases/b2"), Path::new("statepoints/sp1/criu")), "../../statepoints/sp1/criu");
    }

    #[test]
    fn plans_full_then_incremental_until_k() {
        let (_scratch, s) = tmp("plan");
        assert_eq!(plan(&s, "sp1", 7, 3).full_reason.as_deref(), Some("first statepoint of this process tree"));
        let m1 = dump(&s, "sp1", None, 0);
        after_dump(&s, &m1, 7).unwrap();
        let p2 = plan(&s, "sp2", 7, 3);
        assert_eq!((p2.prev_images_dir.as_deref(), p2.depth), (Some("../../sp1/criu"), 1));
        // The chain is relative to the new images directory, as CRIU wants it.
        let m2 = dump(&s, "sp2", Some("../../sp1/criu"), 1);
        after_dump(&s, &m2, 7).unwrap();
        assert_eq!(plan(&s, "sp3", 7, 3).depth, 2, "k = 3: sp1 full, sp2 and sp3 incremental");
        let p3 = plan(&s, "sp3", 7, 2);
        assert!(p3.prev_images_dir.is_none() && p3.full_reason.unwrap().contains("interval"), "k = 2: sp3 is full");
        // Another process tree (restarted container) never builds on this base.
        assert!(plan(&s, "sp3", 8, 100).full_reason.unwrap().contains("restarted"));
    }

    #[test]
    fn a_restore_gets_its_own_base_and_leaves_the_statepoint_untouched() {
        let (_scratch, s) = tmp("base");
        let m1 = dump(&s, "sp1", None, 0);
        let m2 = dump(&s, "sp2", Some("../../sp1/criu"), 1);
        after_restore(&s, &m2, Epoch::Recorded(99_000_000), 42).unwrap();
        let b = read_base(&s).unwrap();
        assert_eq!((b.images.as_deref(), b.depth, b.init_start_time), (Some("bases/b1"), 1, 42));
        let base = s.dir.join("bases/b1");
        assert_eq!(
            criu_hooks::dump_uptime(&std::fs::read(base.join("inventory.img")).unwrap()).unwrap(),
            Some(99_000_000)
        );
        let orig = s.statepoint_dir("sp2").join("criu/inventory.img");
        assert_eq!(criu_hooks::dump_uptime(&std::fs::read(orig).unwrap()).unwrap(), Some(23_270_000));
        // The base reaches sp1 through its own parent link, and the next dump goes through it.
        assert_eq!(parent_of(&base), Some(s.statepoint_dir("sp1").join("criu")));
        assert_eq!(plan(&s, "sp3", 42, 8).prev_images_dir.as_deref(), Some("../../../bases/b1"));
        assert_eq!(std::fs::read_to_string(base.join("pages-1.img")).unwrap(), "sp2");
        let _ = m1;
        // No recorded E: the next dump is full and says why.
        after_restore(&s, &m2, Epoch::Missing("the pre-resume hook recorded no epoch".into()), 43).unwrap();
        let p = plan(&s, "sp3", 43, 8);
        assert_eq!(p.full_reason.as_deref(), Some("the pre-resume hook recorded no epoch"));
        // b1 is no longer the base and nothing links to it: collected.
        assert!(!base.exists());
    }

    #[test]
    fn a_linked_chain_survives_removing_the_source() {
        let (source, s) = tmp("fork-src");
        dump(&s, "sp1", None, 0);
        dump(&s, "sp2", Some("../../sp1/criu"), 1);
        let (_scratch_f, f) = tmp("fork-dst");
        let into = f.statepoint_dir("sp1").join("criu");
        let prev = link_chain(&s.statepoint_dir("sp2").join("criu"), &f, &into).unwrap();
        assert_eq!(prev.as_deref(), Some("../../../bases/b1"));
        // (the source store removed whole)
        drop(source);
        assert!(!s.dir.exists());
        let chain = chain_of(&into);
        assert_eq!(chain.len(), 2);
        assert_eq!(std::fs::read_to_string(into.join("pages-1.img")).unwrap(), "sp2");
        assert_eq!(std::fs::read_to_string(chain[1].join("pages-1.img")).unwrap(), "sp1");
        complete(&into).unwrap();
    }

    #[test]
    fn a_handed_out_chain_is_whole_inside_its_directory_and_imports_into_another_store() {
        let (_scratch, s) = tmp("handout-src");
        dump(&s, "sp1", None, 0);
        dump(&s, "sp2", Some("../../sp1/criu"), 1);
        dump(&s, "sp3", Some("../../sp2/criu"), 2);
        let out = s.dir.parent().unwrap().join("handed-out");
        assert_eq!(hand_out(&s.statepoint_dir("sp3").join("criu"), &out).unwrap(), 3);
        // Every link stays inside: the directory survives the store (another machine).
        std::fs::remove_dir_all(&s.dir).unwrap();
        let chain = chain_of(&out);
        assert_eq!(chain.len(), 3);
        assert!(chain.iter().all(|d| d.starts_with(&out)), "{chain:?}");
        let pages: Vec<String> =
            chain.iter().map(|d| std::fs::read_to_string(d.join("pages-1.img")).unwrap()).collect();
        assert_eq!(pages, ["sp3", "sp2", "sp1"]);
        complete(&out).unwrap();
        // Handed out flat (containerd keeps only the top level's regular files) and laid out
        // again: the same chain.
        std::fs::create_dir_all(out.join("planarian")).unwrap();
        std::fs::write(out.join("planarian/manifest.json"), "{}").unwrap();
        flatten(&out, "planarian").unwrap();
        for e in std::fs::read_dir(&out).unwrap().flatten() {
            assert!(e.file_type().unwrap().is_file(), "{:?} is not a plain file", e.path());
        }
        assert!(out.join("planarian%manifest.json").is_file() && out.join("planarian-chain%2%pages-1.img").is_file());
        unflatten(&out, "planarian").unwrap();
        let again: Vec<String> =
            chain_of(&out).iter().map(|d| std::fs::read_to_string(d.join("pages-1.img")).unwrap()).collect();
        assert_eq!(again, ["sp3", "sp2", "sp1"]);
        assert_eq!(std::fs::read_to_string(out.join("planarian/manifest.json")).unwrap(), "{}");
        complete(&out).unwrap();
        unflatten(&out, "planarian").unwrap();
        std::fs::remove_dir_all(out.join("planarian")).unwrap();
        // A crafted one: a name that climbs out, a link on the way out; refused, nothing moved.
        let away = s.dir.parent().unwrap().join("handout-away");
        std::fs::create_dir_all(&away).unwrap();
        std::fs::write(out.join("planarian%..%..%x"), "x").unwrap();
        assert!(unflatten(&out, "planarian").is_err());
        std::fs::remove_file(out.join("planarian%..%..%x")).unwrap();
        std::os::unix::fs::symlink(&away, out.join("planarian")).unwrap();
        std::fs::write(out.join("planarian%passwd"), "x").unwrap();
        assert!(unflatten(&out, "planarian").is_err());
        assert!(!away.join("passwd").exists() && out.join("planarian%passwd").exists());
        std::fs::remove_file(out.join("planarian%passwd")).unwrap();
        std::fs::remove_file(out.join("planarian")).unwrap();
        // Imported: the newest level a statepoint of the new store, the older ones its bases.
        let (_scratch_f, f) = tmp("handout-dst");
        let into = f.statepoint_dir("sp1").join("criu");
        link_chain(&out, &f, &into).unwrap();
        std::fs::remove_dir_all(&out).unwrap();
        let pages: Vec<String> =
            chain_of(&into).iter().map(|d| std::fs::read_to_string(d.join("pages-1.img")).unwrap()).collect();
        assert_eq!(pages, ["sp3", "sp2", "sp1"]);
        complete(&into).unwrap();
    }

    #[test]
    fn removing_a_middle_statepoint_keeps_the_chain_restorable() {
        let (_scratch, s) = tmp("gc");
        dump(&s, "sp1", None, 0);
        dump(&s, "sp2", Some("../../sp1/criu"), 1);
        let m3 = dump(&s, "sp3", Some("../../sp2/criu"), 2);
        s.mark_discarded("sp2").unwrap();
        collect(&s);
        // sp2 is gone from the registry but its images stay: sp3 needs them.
        assert!(s.find("sp2").is_err());
        assert!(s.statepoint_dir("sp2").join("criu/pages-1.img").exists());
        let chain = chain_of(&s.statepoint_dir("sp3").join("criu"));
        assert_eq!(chain.len(), 3);
        complete(&s.statepoint_dir("sp3").join("criu")).unwrap();
        // Moving the whole store keeps every chain whole: all links are relative.
        let root = s.dir.parent().unwrap().parent().unwrap().to_path_buf();
        let moved = root.with_extension("moved");
        let _ = std::fs::remove_dir_all(&moved);
        std::fs::rename(&root, &moved).unwrap();
        let m = ContainerStore::new(&moved, "c");
        assert_eq!(chain_of(&m.statepoint_dir("sp3").join("criu")).len(), 3);
        complete(&m.statepoint_dir("sp3").join("criu")).unwrap();
        std::fs::rename(&moved, &root).unwrap();
        // Once sp3 is removed too, nothing needs sp2's images, and sp1 is still a statepoint.
        s.mark_discarded("sp3").unwrap();
        collect(&s);
        assert!(!s.statepoint_dir("sp2").exists() && !s.statepoint_dir("sp3").exists());
        assert!(s.statepoint_dir("sp1").join("criu/pages-1.img").exists());
        let _ = m3;
    }
}
