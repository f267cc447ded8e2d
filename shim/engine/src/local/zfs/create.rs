//! A container on ZFS from its first `create`: the dataset it runs on, and the per-image base its
//! dataset is cloned from (the image's layers copied into ZFS once per image).

use super::layers::{apply_layer, overlay_layers};
use super::{mapping, mountpoint, save_mapping, short, zfs_from, Mapping, MAPPING};
use crate::config::Config;
use crate::local::{Error, Result};
use crate::runtime::Bundle;
use crate::store::ContainerStore;
use std::path::PathBuf;
use sys::Context;
use zfs::Zfs;

/// Points a mapped container's OCI config at its dataset (Podman writes its overlay path there
/// on every start and restore). A container without a mapping is left alone.
pub fn prepare_bundle(cfg: &Config, id: &str, bundle: &mut Bundle) -> Result<()> {
    let store = ContainerStore::new(&cfg.store.path, id);
    let Some(map) = mapping(&store) else { return Ok(()) };
    let zfs = zfs_from(cfg)?;
    let mp = mountpoint(&zfs, &map.dataset)?;
    Ok(bundle.point_root_at(&mp)?)
}

/// The `create` hook: maps a new container to its dataset (see the module text) and points its
/// config at it. Containers that are neither on ZFS nor under a configured parent dataset are
/// untouched (the copy-based path).
pub fn on_create(cfg: &Config, id: &str, bundle: &mut Bundle) -> Result<()> {
    let store = ContainerStore::new(&cfg.store.path, id);
    if store.dir.join(MAPPING).exists() {
        return prepare_bundle(cfg, id, bundle);
    }
    let root = bundle.spec.root.clone();
    let mounts = sys::proc::Proc::own().mounts()?;
    let dir = std::fs::canonicalize(&bundle.dir).unwrap_or(bundle.dir.clone());
    if let Some(ds) = zfs::dataset_mounted_at(&mounts, &root) {
        return save_mapping(&store, &Mapping { dataset: ds, owned: false, bundle: dir, image_base: None });
    }
    // Only the ZFS settings matter here; a bad annotation of another kind is reported by the
    // verb that uses it, not by refusing to create the container.
    let cfg = cfg.with_annotations_of(bundle.spec.annotations.iter().map(|(k, v)| (k, v)), Some("zfs"))?;
    let Some(parent) = cfg.zfs.parent_dataset.clone() else { return Ok(()) };
    let Some(layers) = overlay_layers(&mounts, &root) else { return Ok(()) };
    let zfs = zfs_from(&cfg)?;
    let (base, _) = ensure_image_base(&zfs, &cfg, &parent, &layers.lower)?;
    let ds = format!("{parent}/ctr-{id}");
    if zfs.exists(&ds)? {
        // A leftover of a container with this ID whose mapping is gone: not ours to guess about.
        return Err(Error::DatasetExists(ds));
    }
    zfs.clone_snapshot(&base, &ds, &[]).map_err(|source| Error::ZfsStep {
        what: format!("cannot give container {} its dataset", short(id)),
        source,
    })?;
    let r = (|| {
        let mp = mountpoint(&zfs, &ds)?;
        apply_layer(&layers.upper, &mp)?;
        save_mapping(
            &store,
            &Mapping { dataset: ds.clone(), owned: true, bundle: dir.clone(), image_base: Some(base.clone()) },
        )?;
        Ok(bundle.point_root_at(&mp)?)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(store.dir.join(MAPPING));
        let _ = zfs.destroy(&ds, true);
    }
    r
}

/// A stable key for an image: FNV-1a of its layers' paths (they are named by layer ID).
fn image_key(lower: &[PathBuf]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in lower {
        for b in p.as_os_str().as_encoded_bytes().iter().chain(b"\n") {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    format!("{h:016x}")
}

/// The per-image base of an image whose layers are `layers` (top first, as Podman's image
/// inspect lists them), made now when it is missing: what the image's first container's `create`
/// does otherwise, inside Podman's fixed time limit for creating a container. Returns the
/// snapshot, and whether it was made now.
pub fn prepare_image_base(cfg: &Config, parent: &str, layers: &[PathBuf]) -> Result<(String, bool)> {
    // The same key the container's overlay gives: its lower layers, resolved.
    let lower: Vec<PathBuf> = layers.iter().map(|p| std::fs::canonicalize(p).unwrap_or(p.clone())).collect();
    ensure_image_base(&zfs_from(cfg)?, cfg, parent, &lower)
}

/// `<parent>/image-<key>@base`, made once per image: the layers applied bottom-up. Whether it
/// was made now comes with it.
fn ensure_image_base(zfs: &Zfs, cfg: &Config, parent: &str, lower: &[PathBuf]) -> Result<(String, bool)> {
    let ds = format!("{parent}/image-{}", image_key(lower));
    let snap = format!("{ds}@base");
    std::fs::create_dir_all(&cfg.store.path).at("create", &cfg.store.path)?;
    let lock_path = cfg.store.path.join(format!("zfs-image-{}.lock", image_key(lower)));
    let lock =
        std::fs::File::options().create(true).truncate(false).write(true).open(&lock_path).at("open", &lock_path)?;
    lock.lock().at("lock", &lock_path)?;
    if zfs.exists(&snap)? {
        return Ok((snap, false));
    }
    if zfs.exists(&ds)? {
        // A copy that never finished.
        zfs.destroy(&ds, true)?;
    }
    if !zfs.exists(parent)? {
        return Err(Error::NoParentDataset(parent.to_string()));
    }
    zfs.create(&ds, &[])
        .map_err(|source| Error::ZfsStep { what: "cannot create the image's dataset".into(), source })?;
    let r = (|| {
        let mp = mountpoint(zfs, &ds)?;
        for layer in lower.iter().rev() {
            apply_layer(layer, &mp)?;
        }
        zfs.snapshot(&snap)?;
        Ok(zfs.set(&ds, "readonly", "on")?)
    })();
    if let Err(e) = r {
        let _ = zfs.destroy(&ds, true);
        return Err(Error::ImageCopy { dataset: ds, source: Box::new(e) });
    }
    Ok((snap, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_keys_are_stable_and_differ_by_layers() {
        let l = [PathBuf::from("/s/overlay/l/AAA"), PathBuf::from("/s/overlay/l/BBB")];
        assert_eq!(image_key(&l), image_key(&l.clone()));
        assert_ne!(image_key(&l), image_key(&l[..1]));
    }
}
