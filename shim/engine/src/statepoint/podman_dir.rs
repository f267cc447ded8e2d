//! The checkpoint directory Podman and conmon hand to the runtime (`--image-path`, `--work-path`),
//! and a restore through Podman ([`podman_restore`]) to which a rollback hands the container's
//! lock. The lowest layer of the protocols that go through Podman: it calls none of them.
//!
//! A checkpoint leaves what Podman checks and reads there (`inventory.img`, CRIU's log and stats)
//! and a marker naming the statepoint in planarian's store; a restore reads the marker. A
//! directory that leaves the machine carries the statepoint itself ([`super::travel`]).

use super::{Error, Result};
use crate::runtime::podman::{self, PodmanContainer};
use crate::store::{ContainerStore, Manifest};
use serde::{Deserialize, Serialize};
use std::path::Path;
use sys::Context;

/// The marker planarian leaves in a Podman checkpoint directory ([`MARKER`]): which statepoint
/// it stands for. Read by the restore that Podman runs, another planarian process.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Marker {
    container_id: String,
    statepoint_id: String,
}

/// A rollback's hand-over of the container's lock to the restore it started through Podman
/// (`handoff` in the container's store), read by that restore's runtime verb.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct HandoffNote {
    container_id: String,
    pid: u32,
}

/// The marker planarian leaves in Podman's checkpoint directory: which statepoint it is.
pub const MARKER: &str = "planarian-statepoint.json";

/// Leaves what Podman and CRI-O expect after a checkpoint whose directory stays beside the store
/// (a plain Podman checkpoint, a rollback's own restore): `inventory.img` at the image path (both
/// check it before a restore), and [`mark`]. A directory that leaves the machine carries the
/// statepoint itself instead of `inventory.img` ([`super::travel::leave_for_podman`]).
pub fn leave_for_podman(m: &Manifest, sp_dir: &Path, image_path: &Path, work_path: Option<&Path>) -> Result<()> {
    std::fs::create_dir_all(image_path).at("create", image_path)?;
    let images = sp_dir.join(&m.local_state.criu_checkpoint_path);
    std::fs::copy(images.join("inventory.img"), image_path.join("inventory.img"))
        .at("copy inventory.img to", image_path)?;
    mark(m, sp_dir, image_path, work_path)
}

/// What every checkpoint directory gets: our marker at the image path, the CRIU log and stats of
/// statepoint `m` (in `sp_dir`) in the work path.
pub fn mark(m: &Manifest, sp_dir: &Path, image_path: &Path, work_path: Option<&Path>) -> Result<()> {
    let marker = Marker { container_id: m.container_id.clone(), statepoint_id: m.statepoint_id.clone() };
    let text = serde_json::to_string(&marker).expect("strings encode");
    sys::write_atomic(&image_path.join(MARKER), text.as_bytes(), 0o644)?;
    if let Some(w) = work_path {
        let images = sp_dir.join(&m.local_state.criu_checkpoint_path);
        for f in ["stats-dump", "dump.log"] {
            let _ = std::fs::copy(images.join(f), w.join(f));
        }
    }
    Ok(())
}

/// Asks Podman to restore the container from statepoint `m`, handing our lock to the restore;
/// what Podman says of the restore's time, when it says.
pub(super) fn podman_restore(
    store: &ContainerStore,
    pc: &PodmanContainer,
    m: &Manifest,
) -> Result<Option<podman::RestoreStats>> {
    let image_path = pc.bundle.join("checkpoint");
    let _ = std::fs::remove_dir_all(&image_path);
    leave_for_podman(m, &store.statepoint_dir(&m.statepoint_id), &image_path, None)?;
    let handoff = Handoff::give(store, &pc.id)?;
    let r = podman::restore(&pc.id, m.options.tcp_established, true);
    drop(handoff);
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&image_path);
    }
    Ok(r?)
}

/// Which statepoint a Podman checkpoint directory stands for: (container ID, statepoint ID).
pub fn read_marker(image_path: &Path) -> Result<(String, String)> {
    let p = image_path.join(MARKER);
    let data = std::fs::read(&p).map_err(|_| Error::NoMarker(image_path.to_path_buf()))?;
    let m: Marker = serde_json::from_slice(&data).map_err(|_| Error::BadMarker(p))?;
    Ok((m.container_id, m.statepoint_id))
}

/// A rollback's note that it holds the container's lock for the restore it started through
/// Podman; removed when dropped.
pub struct Handoff<'a>(&'a ContainerStore);

impl<'a> Handoff<'a> {
    pub fn give(store: &'a ContainerStore, ctr_id: &str) -> Result<Handoff<'a>> {
        let note = HandoffNote { container_id: ctr_id.to_string(), pid: std::process::id() };
        let text = serde_json::to_string(&note).expect("strings and numbers encode");
        sys::write_atomic(&store.dir.join("handoff"), text.as_bytes(), 0o644)?;
        Ok(Handoff(store))
    }

    /// Whether a live rollback of `ctr_id` handed its lock to this restore.
    pub fn taken(store: &ContainerStore, ctr_id: &str) -> bool {
        let Ok(text) = std::fs::read_to_string(store.dir.join("handoff")) else { return false };
        let Ok(note) = serde_json::from_str::<HandoffNote>(&text) else { return false };
        let holder_alive = i32::try_from(note.pid).is_ok_and(|pid| sys::proc::Proc::of(pid).dir().exists());
        holder_alive && note.container_id == ctr_id
    }
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0.dir.join("handoff"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_and_the_handoff_keep_their_wire_forms() {
        let m = Marker { container_id: "c".into(), statepoint_id: "sp1".into() };
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"container-id":"c","statepoint-id":"sp1"}"#);
        let h = HandoffNote { container_id: "c".into(), pid: 7 };
        assert_eq!(serde_json::to_string(&h).unwrap(), r#"{"container-id":"c","pid":7}"#);
        let scratch = tempfile::tempdir().unwrap();
        std::fs::write(scratch.path().join(MARKER), r#"{"statepoint-id":"sp2","container-id":"d","more":1}"#).unwrap();
        assert_eq!(read_marker(scratch.path()).unwrap(), ("d".into(), "sp2".into()));
        std::fs::write(scratch.path().join(MARKER), r#"{"container-id":"d"}"#).unwrap();
        assert!(matches!(read_marker(scratch.path()), Err(Error::BadMarker(_))));
    }
}
