//! planarian's own settings, read the way containers.conf is read:
//!
//! 1. built-in defaults;
//! 2. `/usr/share/planarian/planarian.conf` (the distribution's file);
//! 3. `/etc/planarian/planarian.conf` (the sysadmin's file);
//! 4. `/etc/planarian/planarian.conf.d/*.conf`, in lexical order;
//! 5. for a non-root user, `$XDG_CONFIG_HOME/planarian/planarian.conf`
//!    (`~/.config/planarian/planarian.conf`).
//!
//! Each later file overrides only the keys it sets. `PLANARIAN_CONFIG=FILE` replaces 2–5 by that
//! one file (as `CONTAINERS_CONF` does). A container can override a few settings with
//! annotations `io.planarian.<table>.<key>` (see [`ANNOTATION_KEYS`]); paths of the binaries
//! that run as root and the store location are deliberately not among them.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const SYSTEM_FILES: &[&str] = &["/usr/share/planarian/planarian.conf", "/etc/planarian/planarian.conf"];
pub const DROPIN_DIR: &str = "/etc/planarian/planarian.conf.d";

/// Settings a container may override by annotation, as `table.key`.
pub const ANNOTATION_KEYS: &[&str] = &[
    "checkpoint.full_dump_interval",
    "checkpoint.pre_resume_hook",
    "checkpoint.network_lock",
    "checkpoint.rollback_in_place",
    "checkpoint.write_ahead",
    "checkpoint.skip_unchanged",
    "checkpoint.lazy_pages",
    "checkpoint.lazy_pages_min_mib",
    "zfs.parent_dataset",
    "store.retention",
    "mcp.service",
    "mcp.disabled",
    "mcp.branch",
];
pub const ANNOTATION_PREFIX: &str = "io.planarian.";

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub runtime: RuntimeConfig,
    pub store: StoreConfig,
    pub checkpoint: CheckpointConfig,
    pub zfs: ZfsConfig,
    pub hooks: HooksConfig,
    pub mcp: McpConfig,
}

/// The MCP state-proxy sidecar. The sysadmin names the services (the real MCP server and its
/// database); a container picks one with the annotation `io.planarian.mcp.service=NAME`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// The service every container gets unless it names another.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Set on forks: the sidecar runs but refuses SQL calls with this reason.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disabled: Option<String>,
    /// Set on forks whose database was branched: the database (on the service's server) this
    /// container's sidecar uses instead of the one the service names; see `McpService::upstream`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    /// planarian-mcp-proxy; when unset, the one beside planarian.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_path: Option<PathBuf>,
    pub services: std::collections::BTreeMap<String, McpService>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct McpService {
    /// The real MCP server, spawned over stdio: program (absolute path) and arguments … Where
    /// the upstream, its URL or its environment name the database as `{dbname}`, a fork gets a
    /// database of its own (a copy at the statepoint: see the proxy's `branch`); otherwise a
    /// fork's SQL calls are refused.
    pub upstream: Vec<String>,
    /// … or reached over Streamable HTTP (`http://127.0.0.1:5000/mcp`).
    pub url: String,
    /// Also serve the harness over Streamable HTTP on this loopback address (`127.0.0.1:0`: a
    /// free port; `planarian-mcp-proxy url CONTAINER` prints the endpoint).
    pub http: String,
    /// Its environment (added to planarian's).
    pub env: std::collections::BTreeMap<String, String>,
    /// `toolbox` (one statement per call) or `dbhub` (several).
    pub server: String,
    /// The database the SQL tools write to, for the proxy's own connection (libpq DSN); empty
    /// for a server without SQL (its tools are then classified by `specs` and annotations).
    pub database: String,
    /// The tool that carries SQL, and its argument.
    pub sql_tool: String,
    pub sql_arg: String,
    /// Declared compensations for the server's other tools: a spec shipped with planarian
    /// (`memory`, `filesystem`) or a TOML file (see the proxy's spec.rs). A tool nothing
    /// classifies is refused.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub specs: Vec<String>,
    /// Tools let through unrecorded (`*`: all that nothing else classifies): every statepoint
    /// taken after such a call says it does not cover this service.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pass: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct HooksConfig {
    /// Remote-state hooks (executables, absolute paths), captured in this order at every
    /// statepoint and compensated in reverse order on rollback. See remote/hooks.rs.
    pub remote: Vec<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// crun, by absolute path; when unset the usual locations are searched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crun_path: Option<PathBuf>,
    /// criu, by absolute path; when unset the usual locations are searched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_path: Option<PathBuf>,
    /// zfs, by absolute path; when unset the usual locations are searched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zfs_path: Option<PathBuf>,
    /// planarian-criu-hooks (the pre-resume hook); when unset, the one beside planarian.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_hooks_path: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Where statepoints live. Never inside Podman's checkpoint directory.
    pub path: PathBuf,
    /// How many committed statepoints to keep per container (0 = keep all).
    pub retention: u32,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// A full memory dump every this many statepoints of a branch (k of Algorithm 1).
    pub full_dump_interval: u32,
    /// Run the pre-resume hook on restore, so the first dump after a restore is incremental.
    /// Off, every restore is followed by a full dump (CRIU's own behaviour).
    pub pre_resume_hook: bool,
    /// How CRIU blocks the container's network while it dumps and restores.
    pub network_lock: NetworkLock,
    /// Roll a running container back in place when its process tree has the statepoint's
    /// shape (no stop, no restore); off, every rollback stops and restores.
    pub rollback_in_place: bool,
    /// A rollback in place writes the pages it can put back as they were (those whose content
    /// the base dump holds) while it still compares the files (see local::inplace::ahead). Off by
    /// default: on two vCPUs the writes slowed the comparison they ran beside as much as they
    /// saved (docs/benchmarks.md); a host with idle cores may gain.
    pub write_ahead: bool,
    /// A statepoint of a sandbox whose processes did nothing since the last dump (the same
    /// processes, memory, descriptors, signals; no page written) takes the last dump's memory
    /// images instead of a new CRIU dump (see local::unchanged); its files are captured as always.
    pub skip_unchanged: bool,
    /// Restore memory on demand: a restored or forked sandbox runs before its memory is all
    /// there; planarian's page server installs each page when it is first touched and the rest in
    /// the background (CRIU's `--lazy-pages` over userfaultfd; see local::lazy).
    pub lazy_pages: bool,
    /// The least memory (MiB) a restore leaves to the page server for it to be on demand; below
    /// it memory is restored whole, which costs less there (the server's start and the settling
    /// outweigh the copy: measured by `bench/run forks`).
    pub lazy_pages_min_mib: u64,
    /// How long a snapshot or rollback waits for tool calls in flight (a `podman exec` still
    /// running, an MCP call that changes something) before it fails, changing nothing.
    pub in_flight_wait_seconds: u64,
}

impl CheckpointConfig {
    pub fn in_flight_wait(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.in_flight_wait_seconds)
    }
}

/// CRIU's `--network-lock`: `nftables` runs inside CRIU (libnftables); `iptables` (CRIU's
/// default) runs `iptables-restore` twice per lock and unlock, a fixed cost of every dump;
/// `auto` is nftables when this CRIU and kernel support it (`criu check --feature
/// network_lock_nftables`, asked once per boot), else iptables.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLock {
    #[default]
    Auto,
    Nftables,
    Iptables,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct ZfsConfig {
    /// Parent dataset under which containers get their own rootfs datasets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_dataset: Option<String>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig { path: PathBuf::from("/var/lib/planarian"), retention: 64 }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            full_dump_interval: 8,
            pre_resume_hook: true,
            network_lock: NetworkLock::Auto,
            rollback_in_place: true,
            write_ahead: false,
            skip_unchanged: true,
            lazy_pages: true,
            lazy_pages_min_mib: 128,
            in_flight_wait_seconds: 120,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("annotation {key}: {message}")]
    Annotation { key: String, message: String },
}

/// The files that make up the configuration, in the order they apply.
pub fn config_files() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("PLANARIAN_CONFIG") {
        return vec![PathBuf::from(p)];
    }
    let mut files: Vec<PathBuf> = SYSTEM_FILES.iter().map(PathBuf::from).collect();
    if let Ok(rd) = std::fs::read_dir(DROPIN_DIR) {
        let mut dropins: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "conf"))
            .collect();
        dropins.sort();
        files.extend(dropins);
    }
    if !nix::unistd::geteuid().is_root() {
        let base = std::env::var_os("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".config")));
        if let Some(base) = base {
            files.push(base.join("planarian/planarian.conf"));
        }
    }
    files
}

impl Config {
    /// Loads the configuration from [`config_files`]. Missing files are skipped, except a file
    /// named by `PLANARIAN_CONFIG`, which must exist.
    pub fn load() -> Result<Config, ConfigError> {
        let explicit = std::env::var_os("PLANARIAN_CONFIG").is_some();
        let mut merged = toml::Table::new();
        for path in config_files() {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => continue,
                Err(source) => return Err(ConfigError::Read { path, source }),
            };
            let table = parse_layer(&path, &text)?;
            merge(&mut merged, table);
        }
        Self::from_table(merged).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("(merged configuration)"),
            message: e.message().to_string(),
        })
    }

    fn from_table(table: toml::Table) -> Result<Config, toml::de::Error> {
        toml::Value::Table(table).try_into()
    }

    /// This configuration with those of a container's annotations that belong to table
    /// `section` (`io.planarian.zfs.*`, …; all of `io.planarian.*` for `None`) applied: the one
    /// filter over a container's annotations. Other annotations are ignored.
    pub fn with_annotations_of<K: AsRef<str>, V: AsRef<str>>(
        &self,
        annotations: impl IntoIterator<Item = (K, V)>,
        section: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let prefix = match section {
            Some(t) => format!("{ANNOTATION_PREFIX}{t}."),
            None => ANNOTATION_PREFIX.to_string(),
        };
        let mine: Vec<(String, String)> = annotations
            .into_iter()
            .filter(|(k, _)| k.as_ref().starts_with(&prefix))
            .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string()))
            .collect();
        self.with_annotations(mine.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// Applies a container's `io.planarian.*` annotations on top of this configuration.
    pub fn with_annotations<'a>(
        &self,
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Config, ConfigError> {
        let mut table: toml::Table =
            toml::Value::try_from(self).ok().and_then(|v| v.as_table().cloned()).unwrap_or_default();
        for (key, value) in annotations {
            let Some(setting) = key.strip_prefix(ANNOTATION_PREFIX) else { continue };
            if !ANNOTATION_KEYS.contains(&setting) {
                return Err(ConfigError::Annotation {
                    key: key.to_string(),
                    message: format!(
                        "not a per-container setting (allowed: {})",
                        ANNOTATION_KEYS
                            .iter()
                            .map(|k| format!("{ANNOTATION_PREFIX}{k}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            let (t, k) = setting.split_once('.').expect("ANNOTATION_KEYS are table.key");
            let v = match (value.parse::<i64>(), value.parse::<bool>()) {
                (Ok(n), _) => toml::Value::Integer(n),
                (_, Ok(b)) => toml::Value::Boolean(b),
                _ => toml::Value::String(value.to_string()),
            };
            table
                .entry(t.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .expect("config tables are tables")
                .insert(k.to_string(), v);
        }
        Self::from_table(table)
            .map_err(|e| ConfigError::Annotation { key: "io.planarian.*".into(), message: e.message().to_string() })
    }
}

/// Parses one file and checks it on its own, so an error names the file it is in.
fn parse_layer(path: &Path, text: &str) -> Result<toml::Table, ConfigError> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.to_string().lines().next().unwrap_or_default().to_string(),
    })?;
    Config::from_table(table.clone())
        .map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.message().to_string() })?;
    Ok(table)
}

/// Merges `over` into `base`: tables key by key, anything else replaced.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layered(files: &[&str]) -> Result<Config, ConfigError> {
        let mut merged = toml::Table::new();
        for (i, text) in files.iter().enumerate() {
            merge(&mut merged, parse_layer(Path::new(&format!("file{i}")), text)?);
        }
        Ok(Config::from_table(merged).unwrap())
    }

    #[test]
    fn defaults() {
        let c = layered(&[]).unwrap();
        assert_eq!(c.store.path, Path::new("/var/lib/planarian"));
        assert_eq!(c.checkpoint.full_dump_interval, 8);
        assert_eq!(c.runtime.crun_path, None);
    }

    #[test]
    fn later_files_override_only_their_keys() {
        let c = layered(&[
            "[runtime]\ncrun_path = \"/opt/crun\"\n[store]\npath = \"/srv/pl\"\n",
            "[store]\nretention = 3\n",
        ])
        .unwrap();
        assert_eq!(c.runtime.crun_path.as_deref(), Some(Path::new("/opt/crun")));
        assert_eq!(c.store.path, Path::new("/srv/pl"));
        assert_eq!(c.store.retention, 3);
    }

    #[test]
    fn unknown_key_names_the_file() {
        let e = layered(&["[runtime]\ncrun = \"/x\"\n"]).unwrap_err().to_string();
        assert!(e.starts_with("file0: "), "{e}");
        assert!(e.contains("crun"), "{e}");
    }

    #[test]
    fn syntax_error_names_the_file() {
        let e = layered(&["", "[store\n"]).unwrap_err().to_string();
        assert!(e.starts_with("file1: "), "{e}");
    }

    #[test]
    fn annotations_override_allowed_settings() {
        let c = Config::default()
            .with_annotations([
                ("io.planarian.checkpoint.full_dump_interval", "3"),
                ("io.planarian.zfs.parent_dataset", "tank/sandboxes"),
                ("org.opencontainers.image.title", "ignored"),
            ])
            .unwrap();
        assert_eq!(c.checkpoint.full_dump_interval, 3);
        let off = Config::default().with_annotations([("io.planarian.checkpoint.pre_resume_hook", "false")]).unwrap();
        assert!(!off.checkpoint.pre_resume_hook);
        assert_eq!(c.zfs.parent_dataset.as_deref(), Some("tank/sandboxes"));
        assert_eq!(c.store, Config::default().store);
    }

    #[test]
    fn network_lock_by_file_or_annotation() {
        assert_eq!(Config::default().checkpoint.network_lock, NetworkLock::Auto);
        let c = layered(&["[checkpoint]\nnetwork_lock = \"iptables\"\n"]).unwrap();
        assert_eq!(c.checkpoint.network_lock, NetworkLock::Iptables);
        let a = c.with_annotations([("io.planarian.checkpoint.network_lock", "nftables")]).unwrap();
        assert_eq!(a.checkpoint.network_lock, NetworkLock::Nftables);
        assert!(layered(&["[checkpoint]\nnetwork_lock = \"skip\"\n"]).is_err());
    }

    #[test]
    fn annotations_cannot_choose_binaries() {
        let e = Config::default()
            .with_annotations([("io.planarian.runtime.crun_path", "/tmp/evil")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a per-container setting"), "{e}");
    }

    #[test]
    fn annotation_of_wrong_type_is_an_error() {
        assert!(Config::default().with_annotations([("io.planarian.checkpoint.full_dump_interval", "often")]).is_err());
    }

    #[test]
    fn shipped_default_file_parses_to_the_defaults() {
        let text = include_str!("../../../containers-conf/planarian.conf");
        let c = layered(&[text]).unwrap();
        assert_eq!(c, Config::default());
    }
}
